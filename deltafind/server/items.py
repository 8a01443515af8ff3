"""Output items for the item-shaped APIs (/v1/responses, /v1/messages): one answer as ordered blocks.

Both APIs stream an answer as blocks that open, grow and close: a reasoning
block, a text block, one block per tool call. `Blocks` turns parser `Delta`s
(server/output.py) into those steps, and `drive` runs a one-choice `RequestRun`
to its end, yielding them (or keep-alive ticks). Wire formats stay in
responses.py and messages.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from deltafind.server.lifecycle import RequestRun
from deltafind.server.output import Delta


@dataclass
class Block:
    kind: str  # reasoning | text | call
    index: int  # its place among the answer's blocks
    call_id: str = ""
    name: str = ""
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass(frozen=True)
class Step:
    what: str  # open | delta | close
    block: Block
    text: str = ""


class Blocks:
    """The blocks of one answer, built from parser deltas in order."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}

    def feed(self, deltas: list[Delta]) -> list[Step]:
        steps: list[Step] = []
        for d in deltas:
            if d.kind == "args":
                block = self._calls[d.index]
            else:
                kind = {"content": "text"}.get(d.kind, d.kind)
                if self._open is None or self._open.kind != kind or kind == "call":
                    steps += self.finish()
                    self._open = Block(
                        kind, len(self.blocks), d.call_id, d.text if kind == "call" else ""
                    )
                    self.blocks.append(self._open)
                    steps.append(Step("open", self._open))
                    if kind == "call":
                        self._calls[d.index] = self._open
                        continue
                block = self._open
            block.parts.append(d.text)
            steps.append(Step("delta", block, d.text))
        return steps

    def finish(self) -> list[Step]:
        """Close the open block (at the answer's end, or when another begins)."""
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [Step("close", block)]


def drive(run: RequestRun, blocks: Blocks, stream: bool) -> Iterator[list[Step] | None]:
    """Run a one-choice request to its end: its block steps per event (None: a keep-alive is due; streamed only)."""
    choice = run.choices[0]
    for ev in run.events(stream):
        if ev is None:
            yield None
            continue
        steps = blocks.feed(choice.take_deltas())
        if ev[3]:  # finished
            steps += blocks.finish()
        if steps:
            yield steps
