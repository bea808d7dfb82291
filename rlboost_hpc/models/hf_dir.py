"""A Hugging Face model directory: the policy the whole run loads (trainer, reserved engine, evaluation, drift).

A model directory holds ``config.json``, one ``model.safetensors`` or several shards listed in
``model.safetensors.index.json``, ``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template, if
any) and optionally ``generation_config.json`` — what ``save_pretrained`` writes for Llama, Qwen2 and Qwen3.

Invariants:
- The architecture comes from :func:`rlboost_hpc.models.arch.arch_from_hf` (the one config reader), the
  tokenizer from ``transformers.AutoTokenizer`` (local files only), the weights from ``safetensors``.
- Anything missing or inconsistent is a :class:`ModelFormatError` naming the file: no config, an unsupported
  architecture (the supported ones are listed), a shard the index names that is absent, tensors missing,
  unexpected or of the wrong shape, no tokenizer, a tokenizer whose vocabulary does not fit the model.
- Stop tokens: ``eos_token_id`` of ``generation_config.json`` (else of ``config.json``; one id or a list) plus
  the tokenizer's EOS, in that order, without duplicates.
- Prompts are rendered through the tokenizer's chat template (one user message, generation prompt added)
  when the tokenizer is in chat mode, else encoded as plain text with the tokenizer's own special tokens
  (e.g. Llama's BOS); a rendered chat template is encoded without adding special tokens again (no doubled BOS).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

import torch

from rlboost_hpc.models.arch import ModelArch, ModelFormatError, arch_from_hf, read_config_json, validate_state_dict
from rlboost_hpc.paths import unreadable

__all__ = ["PolicyModel", "PolicyTokenizer", "load_model_dir", "read_state_dict", "save_model_dir", "weight_files",
           "stop_token_ids", "WEIGHTS_NAME", "WEIGHTS_INDEX_NAME"]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

ChatMode = Literal["auto", "on", "off"]


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a model directory: the shards its index names, else ``model.safetensors``.

    Raises:
        ModelFormatError: no weights, an unreadable index, or a shard the index names that is missing.
    """
    d = Path(path)
    index = d / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelFormatError(f"{index}: not a safetensors index (weight_map): {e}") from None
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ModelFormatError(f"{d}: weight shard(s) {missing} named in {WEIGHTS_INDEX_NAME} are missing")
        return [d / n for n in names]
    if (d / WEIGHTS_NAME).is_file():
        return [d / WEIGHTS_NAME]
    raise ModelFormatError(f"{d}: no weights ({WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} with its shards)")


def read_state_dict(path: str | os.PathLike[str], arch: ModelArch, *,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the model directory ``path`` (CPU, ``dtype``), checked against ``arch``; a tied head
    absent from the files is added as a copy of the embedding (so the dict is the full HF state dict).

    Raises:
        ModelFormatError: see :func:`weight_files`; an unreadable file; a tensor in two shards; tensors missing,
            unexpected or of the wrong shape (named).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelFormatError(f"{f}: unreadable safetensors file: {e}") from None
        dup = sorted(set(part) & set(sd))
        if dup:
            raise ModelFormatError(f"{f}: tensor(s) {dup[:4]} also appear in another shard")
        sd.update(part)
    validate_state_dict(arch, sd, source=str(path))
    sd = {k: v.to(dtype).contiguous() for k, v in sd.items()}
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    return sd


def stop_token_ids(path: str | os.PathLike[str], arch: ModelArch, tokenizer_eos: int | None) -> tuple[int, ...]:
    """Stop tokens of the model directory (see the module docstring for the rule)."""
    ids: list[Any] = []
    gen = Path(path) / "generation_config.json"
    eos: Any = None
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise ModelFormatError(f"{gen}: not a JSON object: {e}") from None
    ids += list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else list(arch.eos_token_ids))
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    out: list[int] = []
    for i in ids:
        if int(i) not in out:
            out.append(int(i))
    return tuple(out)


class PolicyTokenizer:
    """The model's HF tokenizer as the run uses it: prompt ids in, response text out.

    Args:
        hf: a ``transformers`` tokenizer.
        stop_ids: token ids that end a response.
        chat: ``"auto"`` renders prompts through the chat template when the tokenizer has one; ``"on"``
            requires one; ``"off"`` never uses it.

    Raises:
        ModelFormatError: ``chat="on"`` and the tokenizer has no chat template.
    """

    def __init__(self, hf: Any, stop_ids: tuple[int, ...], chat: ChatMode = "auto", source: str = "tokenizer") -> None:
        self.hf = hf
        self.stop_ids = tuple(stop_ids)
        has = bool(getattr(hf, "chat_template", None))
        if chat == "on" and not has:
            raise ModelFormatError(f"{source}: task.chat_template = 'on' but the tokenizer has no chat template "
                                   "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        self.use_chat = has and chat != "off"

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], arch: ModelArch, chat: ChatMode = "auto") -> "PolicyTokenizer":
        """Load the tokenizer of a model directory (local files only).

        Raises:
            ModelFormatError: no tokenizer files, transformers cannot load them, or ids beyond the model's vocabulary.
        """
        d = Path(path)
        if not (d / "tokenizer.json").is_file() and not (d / "tokenizer_config.json").is_file():
            raise ModelFormatError(f"{d}: no tokenizer ({' / '.join(TOKENIZER_FILES)} not found)")
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a broken tokenizer
            if not (d / "tokenizer.json").is_file():  # transformers' advice (install sentencepiece) is not the fix
                present = sorted(p.name for p in d.iterdir() if p.name.startswith("tokenizer") or p.suffix == ".model")
                raise ModelFormatError(
                    f"{d / 'tokenizer.json'} not found: the tokenizer cannot be built from {', '.join(present)} "
                    "alone; copy tokenizer.json from the model's original files (save_pretrained writes it)") from None
            first = (str(e).strip().splitlines() or [""])[0]
            raise ModelFormatError(f"{d}: the tokenizer does not load ({type(e).__name__}: {first})") from None
        if len(hf) > arch.vocab_size:
            raise ModelFormatError(f"{d}: the tokenizer has {len(hf)} tokens but the model's vocab_size is "
                                   f"{arch.vocab_size} (config.json)")
        return cls(hf, stop_token_ids(d, arch, hf.eos_token_id), chat=chat, source=str(d))

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain ``text`` with the tokenizer's own special tokens (e.g. Llama's BOS)."""
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, content: str) -> list[int]:
        """Ids of one user message rendered through the chat template with the generation prompt; the rendered
        text is encoded without adding special tokens (the template writes its own)."""
        text = self.hf.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Ids of a chat (``[{role, content}, ...]``) rendered through the chat template with the generation prompt
        and, when given, the tools' JSON schemas (the template's ``tools=``); encoded without adding special
        tokens (the template writes its own)."""
        text = self.hf.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` with special tokens left out."""
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def render_prompt(self, ids: Iterable[int]) -> str:
        """A prompt's text as the model saw it: a chat prompt with its template's special tokens (role markers,
        generation prompt), a plain prompt without them (:meth:`decode`)."""
        return self.hf.decode(list(ids), skip_special_tokens=False) if self.use_chat else self.decode(ids)


@dataclass
class PolicyModel:
    """A loaded model directory: ``arch``, ``hf_config`` (its ``config.json`` as read — what rollout instances
    receive), ``state_dict`` (fp32 CPU, full HF names) and ``tokenizer``."""

    path: Path
    arch: ModelArch
    hf_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    tokenizer: PolicyTokenizer


def load_model_dir(path: str | os.PathLike[str], *, chat: ChatMode = "auto") -> PolicyModel:
    """Load the model directory ``path`` (see the module docstring).

    Raises:
        ModelFormatError: anything missing or inconsistent (the file is named); UnsupportedModel for another
            architecture.
    """
    d = Path(path).expanduser()
    why = unreadable(d, directory=True)
    if why is not None:  # "not found" only when it is not there
        raise ModelFormatError(f"{d}: model directory {why}")
    hf_config = read_config_json(d)
    arch = arch_from_hf(hf_config, name=str(d / "config.json"))
    tok = PolicyTokenizer.from_dir(d, arch, chat=chat)
    return PolicyModel(path=d, arch=arch, hf_config=hf_config, state_dict=read_state_dict(d, arch), tokenizer=tok)


def save_model_dir(path: str | os.PathLike[str], policy: PolicyModel, state_dict: dict[str, torch.Tensor], *,
                   shard_bytes: int = 4 << 30) -> Path:
    """Write ``state_dict`` (HF names; e.g. the trained policy as rollout instances pull it) as a model directory
    that ``transformers`` and this project load: safetensors shards of at most ``shard_bytes`` bytes with their
    index, ``config.json`` (``torch_dtype`` = the weights' dtype) and every other file of the source directory
    (tokenizer, chat template, generation config). A tied head is not written (as ``save_pretrained`` does).
    Atomic: the directory appears complete or not at all.

    Raises:
        ModelFormatError: ``state_dict`` does not match the policy's architecture.
    """
    from safetensors.torch import save_file

    validate_state_dict(policy.arch, state_dict, source="the exported weights")
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    names = [n for n in sorted(state_dict) if not (n == "lm_head.weight" and policy.arch.tie_word_embeddings)]
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nb = state_dict[n].numel() * state_dict[n].element_size()
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nb
    weight_map: dict[str, str] = {}
    for i, part in enumerate(shards):
        fname = WEIGHTS_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state_dict[n].detach().to("cpu").contiguous() for n in part}, str(tmp / fname),
                  metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    if len(shards) > 1:
        total = sum(state_dict[n].numel() * state_dict[n].element_size() for n in names)
        (tmp / WEIGHTS_INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                          "weight_map": weight_map}, indent=2))
    dtype = str(state_dict[names[0]].dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(dict(policy.hf_config, torch_dtype=dtype), indent=2) + "\n")
    for f in policy.path.iterdir():
        if f.is_file() and f.name != "config.json" and f.name != WEIGHTS_INDEX_NAME and f.suffix != ".safetensors":
            shutil.copyfile(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
