"""Data-plane records (never sent through Temporal)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    """One generated response to one prompt; a row of an experience segment
    (docs/architecture/storage.md, 'Storage layout').

    Every trajectory is generated from start to end by exactly one policy version.
    `finish_reason` is "stop" (EOS), "length" (hit max_new_tokens) or "partial" (in-flight prefix
    in the partial-response pool).
    `tool_mask`: empty when every response token is the model's; otherwise one entry per response token, 1 for
    a model token and 0 for a tool-output token (multi-turn tool calls, envs/tools/__init__.py), which the
    trainer leaves out of the loss and the log-prob comparisons. Segments written before it existed read as [].
    """

    run_id: str
    prompt_id: int
    group_id: str
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float
    policy_version: int
    replica_id: str
    started_at: float
    ended_at: float
    finish_reason: str
    extra: dict[str, str] = field(default_factory=dict)
    tool_mask: list[int] = field(default_factory=list)


def untrainable(t: Trajectory) -> str | None:
    """Why the trainer can never train this row (its lengths disagree), or None. The replica checks each sample
    with it before the sample joins its group (a malformed sample fails the group: generated again, then dropped
    and counted); the trainer's collate refuses such a row for good (laminar/errors.py UntrainableRowError)."""
    r = len(t.response_ids)
    if not t.prompt_ids:
        return "no prompt tokens (the first response token has nothing to be predicted from)"
    if len(t.logprobs) != r:
        return f"{r} response tokens but {len(t.logprobs)} behaviour log-probs"
    if t.tool_mask and len(t.tool_mask) != r:
        return (f"{r} response tokens but a tool_mask of {len(t.tool_mask)}; it must be empty or one entry per "
                "response token")
    return None
