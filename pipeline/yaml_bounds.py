"""Bounds on a YAML document, checked before anything is built from it.

Two small hostile files stop a YAML loader: a list nested 50,000 deep overflows the C loader's stack (the process
dies with SIGSEGV, no Python exception) or gives the pure-Python one a RecursionError thousands of lines long, and a
few hundred bytes of aliases that refer to aliases (a "billion laughs") expand into more objects than memory holds.
Both are found here from the parser's event stream: events come one at a time, with no recursion and no object
built, so the check itself runs in constant stack and memory whatever the file.
"""

from __future__ import annotations

import yaml

MAX_DEPTH = 100
"""Nesting of mappings and sequences a document may have (configs use 2; data files rarely more than 10)."""
MAX_NODES = 2_000_000
"""Nodes a document may expand to, each alias counted as the size of what it names: 2M scalars are far beyond
any config, and beyond a data file's size in bytes for most."""

PARSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YamlBoundsError(ValueError):
    """A document beyond MAX_DEPTH or MAX_NODES; reason is "too_deeply_nested" or "alias_expansion"."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def check_bounds(text: str, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """Raise YamlBoundsError when any document of text nests deeper than max_depth or expands to more than max_nodes
    nodes through its aliases; a syntax error is left to the loader (yaml.YAMLError from the parse)."""
    open_sizes: list[list] = []  # [anchor, nodes so far] of each collection still open
    sizes: dict[str, int] = {}  # anchor -> nodes it expands to
    expanded = 0
    for event in yaml.parse(text, Loader=PARSER):
        if isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent, yaml.CollectionStartEvent)):
            # an alias to a collection still open is recursive: counted as one node (strings_in stops on it)
            n = sizes.get(event.anchor, 1) if isinstance(event, yaml.AliasEvent) else 1
            expanded += n
            if expanded > max_nodes:
                raise YamlBoundsError("alias_expansion", f"it expands to more than {max_nodes:,} nodes through "
                                                         "its aliases")
            if isinstance(event, yaml.CollectionStartEvent):
                if len(open_sizes) >= max_depth:
                    raise YamlBoundsError("too_deeply_nested", f"it is nested deeper than {max_depth} levels")
                open_sizes.append([event.anchor, 1])
                continue
            if isinstance(event, yaml.ScalarEvent) and event.anchor:
                sizes[event.anchor] = 1
            if open_sizes:
                open_sizes[-1][1] += n
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, n = open_sizes.pop()
            if anchor:
                sizes[anchor] = n
            if open_sizes:
                open_sizes[-1][1] += n
