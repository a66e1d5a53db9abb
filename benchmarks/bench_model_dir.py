"""A model directory for benchmarks that need a tokenizer: a preset's config.json (random weights through
`--load-format dummy`) beside a byte-level BPE tokenizer trained here, with as many tokens as the
model's vocabulary, on the Python sources installed on the machine (local; no hub download).

Structured outputs, stop strings and detokenization cost grow with the tokenizer's size, so their
benchmarks need a tokenizer of the real vocabulary's size, not the presets' none.

    python benchmarks/bench_model_dir.py --out /tmp/llama8b_tok
    python benchmarks/throughput.py --model /tmp/llama8b_tok --load-format dummy \
        --structured-outputs '{"regex": "[a-z ]+"}'
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
import time

from common import positive_int

from jengine.presets import resolve_model

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


def corpus_files(max_bytes: int = 100 << 20) -> list[str]:
    """The standard library's .py files, then the installed packages', sorted, up to `max_bytes` (a slim
    Python's standard library alone is too small for a 128k vocabulary)."""
    paths = sysconfig.get_paths()
    files, total = [], 0
    for root in dict.fromkeys((paths["stdlib"], paths["purelib"])):
        for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            if total >= max_bytes:
                return files
            if root == paths["stdlib"] or not path.startswith(paths["stdlib"]):
                files.append(path)
                total += os.path.getsize(path)
    return files


def _texts(files: list[str]):
    """Each file's text (a file that is not UTF-8 gives its decodable parts)."""
    for path in files:
        with open(path, encoding="utf-8", errors="ignore") as f:
            yield f.read()


def train(vocab_size: int, files: list[str]):
    """A byte-level BPE of `vocab_size` tokens (specials last) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(files), trainer)
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   additional_special_tokens=list(SPECIALS[2:]))


def make(out: str, preset: str, vocab_size: int | None = None, files: list[str] | None = None) -> dict:
    """Write the preset's config.json and the trained tokenizer to `out`; returns a summary."""
    model_dir, _ = resolve_model(preset)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    vocab_size = vocab_size or config["vocab_size"]
    if vocab_size > config["vocab_size"]:
        raise ValueError(f"--vocab-size {vocab_size} exceeds the model's vocabulary ({config['vocab_size']})")
    files = files if files is not None else corpus_files()
    t0 = time.perf_counter()
    tokenizer = train(vocab_size, files)
    seconds = time.perf_counter() - t0
    os.makedirs(out, exist_ok=True)
    config.pop("jengine_tokenizer", None)  # a preset's built-in byte tokenizer would win over the trained one
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tokenizer.save_pretrained(out)
    return {"out": out, "tokens": len(tokenizer), "corpus_files": len(files), "train_s": seconds}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory to write (config.json, tokenizer files)")
    ap.add_argument("--model", default="jengine/llama-3.1-8b", help="the preset whose config.json to use")
    ap.add_argument("--vocab-size", type=positive_int, default=None,
                    help="tokens of the tokenizer (default: the model's vocabulary)")
    args = ap.parse_args(argv)
    try:
        summary = make(args.out, args.model, args.vocab_size)
    except ValueError as e:
        ap.error(str(e))
    print(f"{summary['out']}: {summary['tokens']} tokens, trained on {summary['corpus_files']} files in "
          f"{summary['train_s']:.1f} s")
    return summary


if __name__ == "__main__":
    main()
