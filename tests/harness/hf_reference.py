"""The ``transformers`` side of a parity test: greedy ``generate`` and how sure it was of each token.

``hf_greedy_reference`` runs one prompt alone (batch 1: no padding, so nothing but the prompt
shapes HF's numerics) and keeps, for every generated position, the gap between HF's top two
logits. ``assert_same_tokens`` compares our tokens with those and, where they differ, says
whether HF's choice there was a numerical tie in fp32 (gap under ``tie_gap``) — a discrepancy the
test reports as such — or a clear preference, which is a bug.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers


@dataclass(frozen=True)
class Reference:
    """HF's greedy tokens for one prompt (EOS included when it stopped there) and, per token, its
    top-1 minus top-2 logit."""

    tokens: list[int]
    top2_gaps: list[float]

    @property
    def min_gap(self) -> float:
        return min(self.top2_gaps)


def hf_prompt_ids(folder: Path, chats: Sequence[list[dict[str, str]]], completions: Sequence[str]) -> list[list[int]]:
    """``chats`` (the folder's template, with the generation prompt) then ``completions``, tokenized by
    ``transformers.AutoTokenizer`` on the folder: ids that do not depend on our tokenizer module."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    rendered: list[Any] = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)
                           for c in chats]
    return [list(c["input_ids"]) for c in rendered] + [list(tok(t)["input_ids"]) for t in completions]


def hf_logits(hf: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """HF's float32 logits at every position of ``ids`` (one sequence, no padding)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens. Our runs ignore EOS; so must this one: ``min_new_tokens`` would instead
    *mask* EOS (a different sequence), so generation has no EOS at all."""
    ids = torch.tensor([prompt])
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def hf_greedy_reference(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int,
                        eos_token_id: int | None) -> Reference:
    ids = torch.tensor([prompt], device=model.device)   # the model's device (CPU or a GPU)
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos_token_id, pad_token_id=eos_token_id, output_logits=True,
            return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return Reference(tokens, gaps)


def describe_mismatch(job_id: str, ours: list[int], ref: Reference, tie_gap: float) -> str:
    """One line on where ``ours`` leaves ``ref`` and whether HF was tied there."""
    pos = next((i for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)) if a != b),
               min(len(ours), len(ref.tokens)))
    if pos >= len(ref.tokens):
        return f"job {job_id}: ours runs on past HF's {len(ref.tokens)} tokens: {ours[pos:]}"
    gap = ref.top2_gaps[pos]
    got = ours[pos] if pos < len(ours) else "nothing (stopped)"
    kind = (f"NUMERICAL TIE in fp32 (HF top-2 logits {gap:.2e} apart, under {tie_gap:.0e})"
            if gap < tie_gap else f"HF preferred its token by {gap:.3g}: a real discrepancy")
    return f"job {job_id}: first difference at new token {pos}: HF {ref.tokens[pos]}, ours {got} — {kind}"


def assert_same_tokens(ours: Mapping[str, list[int]], refs: Mapping[str, Reference], tie_gap: float) -> None:
    """Exactly HF's tokens for every job; otherwise fail naming each discrepancy and its kind."""
    assert set(ours) == set(refs), f"jobs {sorted(ours)} vs {sorted(refs)}"
    problems = [describe_mismatch(j, ours[j], refs[j], tie_gap) for j in sorted(refs) if ours[j] != refs[j].tokens]
    assert not problems, "\n".join(problems)
