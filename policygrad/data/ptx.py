"""Text for PPO-ptx: a cyclic, resumable stream of tokenized pretraining/SFT text whose
language-modelling loss joins the policy update (Ouyang et al. 2022, eq. 2)."""

from __future__ import annotations

import json
import os

import torch

__all__ = ["PtxData"]


class PtxData:
    """A cyclic, resumable stream of tokenized text for the PPO-ptx language-modelling loss.

    Args:
        path: a JSONL file, one object per line with a string field ``field`` (blank lines
            skipped).
        tokenizer: the POLICY's tokenizer.
        field: the text field, default ``"text"``.
        max_length: tokens per text, >= 2 (longer texts are cut at the end).
        batch_size: texts per batch, >= 1.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line that is not a JSON object with a non-empty string ``field`` (names the
            line and the fields present); no text with at least 2 tokens; bad sizes.
    """

    def __init__(
        self, path: str, tokenizer, *, field: str = "text", max_length: int = 256, batch_size: int = 4
    ):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"ptx.dataset {path!r} does not exist; give a JSONL file of {{{field!r}: ...}}"
            )
        if max_length < 2:
            raise ValueError(f"ptx.max_length must be >= 2, got {max_length}")
        if batch_size < 1:
            raise ValueError(f"ptx.batch_size must be >= 1, got {batch_size}")
        self.sequences: list[list[int]] = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"ptx.dataset {path}:{lineno} is not valid JSON ({exc})") from None
                text = row.get(field) if isinstance(row, dict) else None
                if not isinstance(text, str) or not text:
                    fields = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
                    raise ValueError(
                        f"ptx.dataset {path}:{lineno} has no non-empty string field {field!r} "
                        f"(fields: {fields}); set ptx.text_field"
                    )
                ids = tokenizer(text, add_special_tokens=True, truncation=True, max_length=max_length)[
                    "input_ids"
                ]
                if len(ids) >= 2:
                    self.sequences.append(list(ids))
        if not self.sequences:
            raise ValueError(f"ptx.dataset {path} holds no text of at least 2 tokens")
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.batch_size = batch_size
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``batch_size`` texts (wrapping around), right-padded.

        Returns:
            ``(input_ids LongTensor [b, L], attention_mask LongTensor [b, L])``.
        """
        seqs = [self.sequences[(self.position + i) % len(self.sequences)] for i in range(self.batch_size)]
        self.position += self.batch_size
        length = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        return ids, mask
