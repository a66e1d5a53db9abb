"""The built-in byte tokenizer (ids 0-255 are UTF-8 bytes, 256.. special tokens) and load_tokenizer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from jengine.tokenizer import BYTE_SPECIALS, byte_tokenizer, load_tokenizer, render_chat

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models")
TOK = byte_tokenizer()
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüß dich 👋"}]


def ids_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_ids(tok, messages, add_generation_prompt: bool) -> list[int]:
    """Token ids of a rendered chat; transformers 5 returns a BatchEncoding for tokenize=True."""
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("text", [
    "hello, world",
    "Grüße aus Köln — ça va?",
    "日本語のテキスト 中文 한국어",
    "Привет, мир! Γειά σου",
    "emoji 🎉👩‍👩‍👧 🇩🇪 and skin tone 👍🏽",
    "  leading and trailing spaces\n\ttabs\r\n",
    "",
])
def test_byte_tokenizer_round_trips_text_as_utf8_bytes(text):
    ids = TOK.encode(text, add_special_tokens=False)
    assert ids == ids_of(text)
    assert TOK.decode(ids) == text


def test_plain_encode_adds_no_bos():
    assert TOK.encode("ab") == [97, 98]


def test_every_byte_value_round_trips():
    assert len(set(TOK.convert_ids_to_tokens(list(range(256))))) == 256  # one distinct token per byte
    raw = "".join(chr(c) for c in range(1, 0x250))
    assert TOK.decode(TOK.encode(raw, add_special_tokens=False)) == raw


def test_special_token_ids_follow_the_bytes():
    assert TOK.convert_tokens_to_ids(list(BYTE_SPECIALS)) == [256, 257, 258, 259, 260]
    assert (TOK.bos_token, TOK.bos_token_id) == ("<|begin_of_text|>", 256)
    assert (TOK.eos_token, TOK.eos_token_id) == ("<|end_of_text|>", 257)
    assert len(TOK) == 261


def test_special_tokens_in_text_encode_to_single_ids_and_can_be_skipped():
    ids = TOK.encode("<|begin_of_text|>hi<|eot|>", add_special_tokens=False)
    assert ids == [256, 104, 105, 260]
    assert TOK.decode(ids) == "<|begin_of_text|>hi<|eot|>"
    assert TOK.decode(ids, skip_special_tokens=True) == "hi"


def test_tiny_llama_preset_special_ids_fit_its_vocab():
    tok = load_tokenizer("jengine/tiny-llama")
    assert tok.convert_tokens_to_ids(list(BYTE_SPECIALS)) == [256, 257, 258, 259, 260]
    assert len(tok) <= 384  # the preset's vocab_size; its bos 256 and eos 257/260 are these specials


def test_chat_template_renders_roles_and_generation_prompt():
    text = TOK.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|>"
                    "<|start_header|>system<|end_header|>Be brief.<|eot|>"
                    "<|start_header|>user<|end_header|>Grüß dich 👋<|eot|>"
                    "<|start_header|>assistant<|end_header|>")
    want = ([256, 258] + ids_of("system") + [259] + ids_of("Be brief.") + [260]
            + [258] + ids_of("user") + [259] + ids_of("Grüß dich 👋") + [260]
            + [258] + ids_of("assistant") + [259])
    assert TOK.encode(text, add_special_tokens=False) == want
    assert chat_ids(TOK, MESSAGES, add_generation_prompt=True) == want


def test_chat_template_without_generation_prompt_ends_at_last_turn():
    text = TOK.apply_chat_template(MESSAGES[1:], tokenize=False, add_generation_prompt=False)
    assert text == "<|begin_of_text|><|start_header|>user<|end_header|>Grüß dich 👋<|eot|>"
    assert chat_ids(TOK, MESSAGES[1:], add_generation_prompt=False)[-1] == 260


def test_render_chat_encodes_the_rendered_text_without_adding_special_tokens():
    assert render_chat(TOK, MESSAGES, add_generation_prompt=True) == chat_ids(TOK, MESSAGES, True)
    cont = render_chat(TOK, MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert TOK.decode(cont) == "<|begin_of_text|><|start_header|>system<|end_header|>Be brief.<|eot|>" \
        "<|start_header|>user<|end_header|>Grüß dich 👋"


def test_render_chat_takes_the_given_template_and_needs_one_where_the_tokenizer_has_none():
    bare = byte_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat_template must be given: this model's tokenizer has no chat template"):
        render_chat(bare, MESSAGES, add_generation_prompt=True)
    template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}{{ suffix }}"
    ids = render_chat(bare, MESSAGES, add_generation_prompt=True, chat_template=template,
                      chat_template_kwargs={"suffix": "<|eot|>"})
    assert ids == ids_of("s:Be brief.;u:Grüß dich 👋;") + [260]


def test_preset_with_bytes_marker_gets_byte_tokenizer():
    tok = load_tokenizer("jengine/tiny-llama")
    assert tok.encode("é🎉", add_special_tokens=False) == ids_of("é🎉")
    assert tok.chat_template == TOK.chat_template


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fixture_without_tokenizer_files_has_no_tokenizer(name, tmp_path):
    # fixtures ship config and weights only
    assert load_tokenizer(os.path.join(FIXTURES_DIR, name)) is None
    shutil.copy(os.path.join(FIXTURES_DIR, name, "config.json"), tmp_path / "config.json")
    assert load_tokenizer(str(tmp_path)) is None


def test_directory_with_tokenizer_json_loads_it(tmp_path):
    shutil.copy(os.path.join(FIXTURES_DIR, "llama", "config.json"), tmp_path / "config.json")
    TOK.save_pretrained(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert tok is not None
    assert tok.encode("ça 🎉", add_special_tokens=False) == ids_of("ça 🎉")
    assert tok.convert_tokens_to_ids("<|eot|>") == 260


def test_load_tokenizer_of_unknown_model_mentions_presets():
    with pytest.raises(ValueError, match="neither a local directory nor a built-in preset"):
        load_tokenizer("/no/such/model")


def test_engine_imports_and_a_model_without_tokenizer_do_not_import_transformers():
    # where torch is installed, importing transformers costs seconds of start-up
    code = ("import sys; import jengine.llm; from jengine.tokenizer import load_tokenizer; "
            f"assert load_tokenizer({os.path.join(FIXTURES_DIR, 'llama')!r}) is None; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
