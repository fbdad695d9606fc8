#!/usr/bin/env bash
# Make sure a PostgreSQL server answers on 127.0.0.1:5432 with trust auth and a
# database `test`; install and start one where none does.
set -euo pipefail
if pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  exit 0
fi
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql
fi
version=$(ls /etc/postgresql | sort -V | tail -n 1)
conf=/etc/postgresql/$version/main
if ! grep -q "kvledger trust" "$conf/pg_hba.conf"; then
  sed -i '1i host all all 127.0.0.1/32 trust # kvledger trust\nlocal all all trust # kvledger trust' "$conf/pg_hba.conf"
fi
pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
for _ in $(seq 1 30); do
  pg_isready -h 127.0.0.1 -p 5432 -q && break
  sleep 1
done
pg_isready -h 127.0.0.1 -p 5432
su postgres -c "psql -h 127.0.0.1 -tc \"SELECT 1 FROM pg_database WHERE datname='test'\"" | grep -q 1 \
  || su postgres -c "createdb -h 127.0.0.1 test"
