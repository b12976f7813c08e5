"""The checkpoint of a conversation as its next turn will re-send it, for templates that think.

A thinking template's generation prompt opens a block (Qwen3.5: `<|im_start|>assistant\\n<think>\\n`) that the turn's
history form does not have: the next turn re-sends the answer without its reasoning, so neither this turn's
prompt-end nor its generation-end checkpoint lies on the next prompt's path, and a hybrid model would recompute the
whole conversation (a pure-attention engine keeps the KV up to the fork; recurrent state has no such prefix).

    this turn     [conversation][assistant\\n][<think>\\n][reasoning </think>\\n\\n answer <|im_end|>]
    next turn     [conversation][assistant\\n][answer <|im_end|>\\n][<|im_start|>user ...]
                                            ^ shared_len: the request also stores a checkpoint here
                  [ ...  next_prompt(answer) ...            ] a warm request stores this one's prompt end

`shared_len` gives the prompt length the history form shares, where the request stores one more checkpoint
(`SamplingParams.checkpoint_at`). Once the answer is known, `next_prompt` is the conversation with the answer as the
next turn renders it; when it is not this request's prompt + output (which the generation-end checkpoint covers),
the route sends it as a warm request (`SamplingParams.warm`: one token, dropped, outside the request telemetry) that
resumes from the shared-length checkpoint and stores its prompt end, when the answer re-sent beyond that checkpoint
is long enough to pay for a request (MIN_WARM tokens; a shorter one the next turn computes itself). The answer's
tokens are then computed once, between the turns, and the next turn resumes at the start of its new message (a user
message after a plain answer, the tool results after calls). The answer is taken as clients re-send it, without
`reasoning_content`; a client that sends the reasoning back renders this turn's prompt + output, which the
generation-end checkpoint covers. One choice only. A warm request still running when a prompt that extends it
arrives (the next turn sent at once, with no pause between the turns) is cancelled: the new prompt computes the same
tokens on its own way, and both at once would compute them twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from app.models.tokenizer import Tokenizer

MIN_SHARED = 16  # a shorter shared prefix is not worth a checkpoint slot
# fewer re-sent tokens beyond the shared-length checkpoint than this, and the next turn computes them itself: a warm
# request costs a request's round trip and an engine step, which a few tokens do not repay (a judgement, not measured)
MIN_WARM = 64


def shared_len(tok: Tokenizer, prompt: list[int], messages: Sequence[Mapping], kwargs: Mapping,
               tools: Sequence[Mapping] | None = None) -> int | None:
    """The length of `prompt` that the next turn's history form of this turn shares, when it is shorter than the
    prompt (the generation prompt adds tokens the history form lacks) and at least MIN_SHARED; else None."""
    try:
        history = tok.encode_chat_continuation(messages, {"role": "assistant", "content": ""}, tools, **kwargs)
    except ValueError:  # a template that closes turns some other way: nothing to place
        return None
    n = next((i for i, (a, b) in enumerate(zip(prompt, history)) if a != b), min(len(prompt), len(history)))
    return n if MIN_SHARED <= n < len(prompt) else None


def next_prompt(tok: Tokenizer, prompt: list[int], output: list[int], messages: Sequence[Mapping], answer: Mapping,
                kwargs: Mapping, tools: Sequence[Mapping] | None = None, shared: int | None = None) -> list[int] | None:
    """The ids of the conversation with the assistant message `answer` as the next turn re-sends it, when a warm
    request of them pays: they are not `prompt + output` already (which the generation-end checkpoint covers), and
    they run at least MIN_WARM tokens beyond the shared-length checkpoint (`shared`) the request stored; else None."""
    try:
        ids = tok.encode_chat_continuation(messages, answer, tools, **kwargs)
    except ValueError:
        return None
    done = prompt + output
    if ids[: len(done)] == done or len(ids) - (shared or 0) < MIN_WARM:
        return None
    return ids
