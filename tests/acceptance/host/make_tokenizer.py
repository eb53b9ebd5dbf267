"""Write an offline Hugging Face cache for ``openai/clip-vit-large-patch14`` (tokenizer + config).

SD1.5 in AUTOMATIC1111 v1.10.1 builds ``CLIPTokenizer`` and the text model's ``CLIPTextConfig``
from the hub name ``openai/clip-vit-large-patch14``; offline they must come from the local cache
(``HF_HOME``). ``vocab.json`` and ``merges.txt`` are derived from openai/CLIP's
``bpe_simple_vocab_16e6.txt.gz`` exactly as CLIP's ``SimpleTokenizer`` builds its vocabulary; the
JSON configs carry the published values. No weights: the WebUI builds the text model from the
config and fills it from the checkpoint.

Run it with the host venv's Python; ``--check`` (default on) compares the cached tokenizer with
CLIP's own ``SimpleTokenizer`` on a few prompts.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
from pathlib import Path

REPO_ID = "openai/clip-vit-large-patch14"

TEXT_CONFIG = {
    "model_type": "clip_text_model",
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-05,
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "initializer_range": 0.02,
    "initializer_factor": 1.0,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
VISION_CONFIG = {
    "model_type": "clip_vision_model",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "projection_dim": 768,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 14,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-05,
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "initializer_range": 0.02,
    "initializer_factor": 1.0,
}
CONFIG = {
    "_name_or_path": REPO_ID,
    "architectures": ["CLIPModel"],
    "model_type": "clip",
    "projection_dim": 768,
    "logit_scale_init_value": 2.6592,
    "initializer_factor": 1.0,
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
    "transformers_version": "4.30.2",
}


def _token(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    }


TOKENIZER_CONFIG = {
    "add_prefix_space": False,
    "bos_token": _token("<|startoftext|>"),
    "eos_token": _token("<|endoftext|>"),
    "unk_token": _token("<|endoftext|>"),
    "pad_token": "<|endoftext|>",
    "do_lower_case": True,
    "errors": "replace",
    "model_max_length": 77,
    "name_or_path": REPO_ID,
    "tokenizer_class": "CLIPTokenizer",
}
SPECIAL_TOKENS_MAP = {
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
}


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's (and GPT-2's) reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def find_bpe() -> Path:
    """bpe_simple_vocab_16e6.txt.gz from the installed ``clip`` or ``open_clip`` package."""
    import importlib.util

    for pkg in ("clip", "open_clip"):
        spec = importlib.util.find_spec(pkg)
        if spec and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                p = Path(loc) / "bpe_simple_vocab_16e6.txt.gz"
                if p.is_file():
                    return p
    raise SystemExit("bpe_simple_vocab_16e6.txt.gz not found (install clip or open-clip-torch)")


def vocab_and_merges(bpe: Path) -> tuple[dict[str, int], list[str]]:
    with gzip.open(bpe) as f:
        lines = f.read().decode("utf-8").split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}, merges


def write_cache(hf_home: Path, bpe: Path) -> Path:
    vocab, merges = vocab_and_merges(bpe)
    files = {
        "config.json": json.dumps(CONFIG, indent=2) + "\n",
        "tokenizer_config.json": json.dumps(TOKENIZER_CONFIG, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(SPECIAL_TOKENS_MAP, indent=2) + "\n",
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
    }
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + files[name].encode())
    revision = digest.hexdigest()
    repo = hf_home / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (snap / name).write_text(text, encoding="utf-8")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    # transformers' cache-layout marker: without it, it warns offline that the cache "seems to be
    # the one of a previous version" and tries a migration
    (hf_home / "hub" / "version.txt").write_text("1")
    return snap


def check(hf_home: Path) -> None:
    """Load the tokenizer and config offline, compare with CLIP's own tokenizer."""
    os.environ["HF_HOME"] = str(hf_home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from clip.simple_tokenizer import SimpleTokenizer
    from transformers import CLIPTextConfig, CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(REPO_ID)
    ref = SimpleTokenizer()
    prompts = [
        "a red apple on a wooden table",
        "masterpiece, (best quality:1.2), 1girl, <lora:x:0.5>",
        "Ünïcödé, 東京, emoji 🍎 and numbers 12345",
    ]
    for p in prompts:
        got = tok(p)["input_ids"]
        want = [ref.encoder["<|startoftext|>"]] + ref.encode(p) + [ref.encoder["<|endoftext|>"]]
        if got != want:
            raise SystemExit(f"tokenizer mismatch for {p!r}:\n {got}\n {want}")
    cfg = CLIPTextConfig.from_pretrained(REPO_ID)
    assert cfg.hidden_size == 768 and cfg.num_hidden_layers == 12, cfg
    print(f"tokenizer check: {len(prompts)} prompts identical to CLIP's SimpleTokenizer; text config ok")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-home", type=Path, required=True, help="the HF_HOME launch.sh sets")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    bpe = find_bpe()
    snap = write_cache(args.hf_home, bpe)
    print(f"wrote {snap} (from {bpe})")
    if not args.no_check:
        check(args.hf_home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
