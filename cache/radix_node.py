"""The radix prefix tree's nodes and the walks along their parent links (cache/radix_tree.py owns them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: list[int]  # tokens on the edge from the parent; len == len(blocks) * block_size
    blocks: list[int]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    last_access: int = 0
    alive: bool = True
    namespace: str = ""  # set on roots only


def descendants(root: Node) -> list[Node]:
    """Every node below root."""
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def path_to_root(node: Node) -> Iterator[Node]:
    """node, its parent, ... up to (not including) the root."""
    while node.parent is not None:
        yield node
        node = node.parent


def path_blocks(handle: Node | None) -> list[int]:
    """Block ids from the root down to `handle` (inclusive)."""
    if handle is None:
        return []
    return [b for node in reversed(list(path_to_root(handle))) for b in node.blocks]


def root_of(node: Node) -> Node:
    """The namespace root above node."""
    while node.parent is not None:
        node = node.parent
    return node
