"""A Hypothesis profile for mutation testing (benchmarks/mutation.py): find, never shrink.

A mutant that breaks a property is killed by the first failing example; shrinking it would cost
minutes per mutant and tell the benchmark nothing more. Selected by KVLEDGER_HYPOTHESIS_PROFILE;
unset (CI, people), the per-test settings apply as written.
"""

from __future__ import annotations

import os

from hypothesis import Phase, settings

settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None)
if os.environ.get("KVLEDGER_HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["KVLEDGER_HYPOTHESIS_PROFILE"])
