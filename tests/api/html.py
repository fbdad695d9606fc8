"""Reading the service's pages in tests: elements by tag, class, id or data attribute, with their text."""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    text: str = ""
    children: list[Element] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def find_all(self, selector: str) -> list[Element]:
        """`tag`, `.class`, `#id`, `tag.class.other` or `[data-x=value]`: every match below this element."""
        out = []
        for child in self.children:
            if _matches(child, selector):
                out.append(child)
            out.extend(child.find_all(selector))
        return out

    def find(self, selector: str) -> Element:
        found = self.find_all(selector)
        assert found, f"no element matches {selector!r}"
        return found[0]


def _matches(e: Element, selector: str) -> bool:
    if selector.startswith("[") and selector.endswith("]"):
        name, _, value = selector[1:-1].partition("=")
        return name in e.attrs and (not value or e.attrs[name] == value.strip("'\""))
    if selector.startswith("#"):
        return e.attrs.get("id") == selector[1:]
    tag, *classes = selector.split(".")
    return (not tag or e.tag == tag) and set(classes) <= e.classes


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(element)
        if tag not in VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        for element in self.stack:
            element.text += data  # every open element's text includes its descendants'


def parse(html: str) -> Element:
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.root
