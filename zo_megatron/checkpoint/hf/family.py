"""What every Hugging Face family module provides, and the file handling they share.

A family maps one or more HF `architectures` to megatron-core's GPTModel. It works on FULL
unpadded tensors (TP is the layout code's business) and on `meta`, the model's architecture as
GPTConfig field values (model/config.py ARCH_FIELDS). Reading never runs code: configs are JSON
read by transformers' own config classes (no trust_remote_code), weights come from safetensors or
`torch.load(weights_only=True)`.
"""
from __future__ import annotations

import abc
import json
import os

import torch

from zo_megatron.errors import UserError

CONFIG = "config.json"
_SAFETENSORS, _SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
_BIN, _BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


class HFFamily(abc.ABC):
    """One Hugging Face architecture <-> zo_megatron. Subclasses fill in the mapping."""

    architecture: str = ""                     # config.json's `architectures[0]`
    model_type: str = ""                       # config.json's `model_type`
    zero_centred_norms: bool = False           # its norms scale by 1 + weight (to_hf_state gets such weights)
    # HF names (their ends) to-hf writes in fp32 whatever --dtype: what transformers' model keeps in fp32
    # (_keep_in_fp32_modules_strict) and save_pretrained writes so, e.g. a router's weight and bias
    fp32_tensors: tuple[str, ...] = ()

    @abc.abstractmethod
    def read_config(self, cfg_json: dict, where: str):
        """The transformers config object of this family from config.json's contents."""

    @abc.abstractmethod
    def meta_from_config(self, cfg, where: str) -> tuple[dict, dict]:
        """(meta, args): GPTConfig architecture fields, and run args (dropouts) for the checkpoint;
        refuses with one line what the model cannot express."""

    @abc.abstractmethod
    def read_state(self, input_dir: str, cfg, meta: dict) -> dict[str, torch.Tensor]:
        """Full weights under our parameter names, read from the HF directory, in the files' dtype
        (the checkpoint writer converts each box to fp32 as it writes it)."""

    @abc.abstractmethod
    def why_not(self, meta: dict) -> str | None:
        """None if this HF architecture expresses the model `meta` exactly, else why not (a phrase)."""

    @abc.abstractmethod
    def to_hf_state(self, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
        """HF state dict (a tied lm_head left out: transformers re-ties it on load)."""

    @abc.abstractmethod
    def hf_config(self, meta: dict, *, dtype: str, args: dict, bos_token_id, eos_token_id, window: dict | None = None):
        """The transformers config object to save next to the weights (`window`: the model's sliding window as
        planner/window.py hf_window says it, {"tokens": W, "layers"}; None: full attention)."""

    def attention_window(self, cfg) -> dict | None:
        """The sliding window transformers' model of this config applies ({"tokens": W, "layers": the
        0-indexed layers it limits}), None for full attention."""
        return None

    def window_support(self) -> str | None:
        """Which sliding windows the family's model can apply: None (none), "every_layer" (Mistral,
        StarCoder2) or "layer_types" (Qwen2, Qwen3: any set of layers)."""
        return getattr(getattr(self, "variant", None), "window", None)

    def config_json_extra(self, meta: dict) -> dict:
        """Keys to add to the config.json the installed transformers wrote: what readers of the other
        config schema need (none unless the family has two)."""
        return {}

    def left_out(self, input_dir: str, cfg) -> str | None:
        """What from-hf leaves out of the HF directory's model (a phrase for its log: tensors that
        transformers' model of this config does not build either), None if nothing."""
        return None


class VariantFamily(HFFamily):
    """A family whose Hugging Face architectures differ as data: `variant` (a frozen dataclass of its module)
    names the architecture, the model_type and the transformers config class."""

    def __init__(self, variant):
        self.variant = variant
        self.architecture, self.model_type = variant.architecture, variant.model_type

    def _config_class(self):
        import transformers

        return getattr(transformers, self.variant.config_class)

    def read_config(self, cfg_json: dict, where: str):
        return read_hf_config(self._config_class(), cfg_json, where)

    def _config_refuses(self, meta: dict) -> str | None:
        """What the installed transformers' config class refuses of the model, as a phrase; None if it takes
        it (LlamaConfig and DeepseekV2Config validate hidden_size % num_attention_heads even where the heads
        have a head_dim of their own)."""
        from huggingface_hub.errors import StrictDataclassError

        try:
            self.hf_config(meta, dtype="float32", args={}, bos_token_id=None, eos_token_id=None)
        except (StrictDataclassError, ValueError, TypeError) as exc:
            cause = exc.__cause__ or exc
            return f"transformers' {self.variant.config_class} refuses it ({str(cause).strip().splitlines()[-1][:200]})"
        return None


def read_config_json(input_dir: str) -> dict:
    """config.json of a HF model directory; a hub id or a missing file is one line."""
    if not os.path.isdir(input_dir):
        hub_id = not os.path.isabs(input_dir) and not input_dir.startswith(".") and input_dir.count("/") <= 1 \
            and not os.path.exists(input_dir)
        if hub_id:                     # e.g. "gpt2", "openai-community/gpt2": a name on the Hub
            local = input_dir.rstrip("/").split("/")[-1]
            raise UserError(f"--input {input_dir}: no such directory; conversion reads a local model directory (it "
                            f"downloads nothing): if {input_dir!r} is a Hugging Face Hub id, fetch it first with "
                            f"`huggingface-cli download {input_dir} --local-dir {local}` and pass --input {local}")
        raise UserError(f"--input {input_dir}: no such directory; point it at a Hugging Face model directory")
    path = os.path.join(input_dir, CONFIG)
    if not os.path.isfile(path):
        raise UserError(f"{input_dir}: no {CONFIG}: not a Hugging Face model directory")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot be read as JSON ({str(exc).splitlines()[0][:160]})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: not a JSON object")
    return cfg


def weight_files(input_dir: str) -> list[str]:
    """The weight files of a HF directory: safetensors preferred (one file or an index), else
    pytorch_model.bin (one file or an index)."""
    for single, index in ((_SAFETENSORS, _SAFETENSORS_INDEX), (_BIN, _BIN_INDEX)):
        if os.path.isfile(os.path.join(input_dir, single)):
            return [os.path.join(input_dir, single)]
        ipath = os.path.join(input_dir, index)
        if os.path.isfile(ipath):
            try:
                with open(ipath) as f:
                    weight_map = json.load(f)["weight_map"]
                names = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise UserError(f"{ipath}: not a weight index (no 'weight_map')") from None
            files = [os.path.join(input_dir, n) for n in names]
            for f in files:
                if os.path.dirname(os.path.abspath(f)) != os.path.abspath(input_dir) or not os.path.isfile(f):
                    raise UserError(f"{ipath} names {os.path.basename(f)!r}, which is not a file in {input_dir}")
            return files
    raise UserError(f"{input_dir}: no weights ({_SAFETENSORS}, {_SAFETENSORS_INDEX}, {_BIN} or {_BIN_INDEX}): "
                    "download the model's weight files too")


def read_state_dict(input_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the HF directory's weight files, as saved (HF names, their dtypes)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in weight_files(input_dir):
        try:
            if path.endswith(".safetensors"):
                part = load_file(path)
            else:                                 # never unpickle code from a user's file
                part = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (SafetensorError, OSError, RuntimeError, ValueError, EOFError) as exc:
            raise UserError(f"{path}: cannot be read ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise UserError(f"{path}: not a state dict of tensors")
        out.update(part)
    return out


def stored_tensor_names(input_dir: str) -> set[str] | None:
    """The tensor names of a HF directory's weight files, read without their data (safetensors headers; a
    .bin through mmap); None where a file cannot be read (read_state_dict then says why, in one line)."""
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    try:
        for path in weight_files(input_dir):
            if path.endswith(".safetensors"):
                with safe_open(path, "pt") as f:
                    names.update(f.keys())
            else:                               # never unpickle code; mmap: the data is not read
                names.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except (SafetensorError, OSError, RuntimeError, ValueError, EOFError, TypeError):
        return None
    return names


def read_hf_config(config_class, cfg_json: dict, where: str):
    """config.json's contents as transformers' `config_class` reads them; `auto_map` is dropped (it
    names remote code, which conversion never runs); an invalid config is one line (transformers 5's strict
    config classes raise huggingface_hub's StrictDataclassError, whose cause names the field's problem)."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return config_class.from_dict({k: v for k, v in cfg_json.items() if k != "auto_map"})
    except StrictDataclassError as exc:
        cause = exc.__cause__ or exc
        raise UserError(f"{where}: not a valid {config_class.__name__} ({type(cause).__name__}: "
                        f"{str(cause).strip().splitlines()[-1].strip()[:200]})") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise UserError(f"{where}: not a valid {config_class.__name__} ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from None


def read_checked_state_dict(input_dir: str, meta: dict, expected: dict[str, tuple[int, ...]], architecture: str,
                            extra_hint: str = "", drop=None) -> dict[str, torch.Tensor]:
    """The HF directory's tensors, refused in one line unless they are exactly `expected` (name ->
    shape) once old files' RoPE buffers, a tied lm_head and the names `drop(name)` is true of (what the
    family leaves out: left_out) are set aside; `extra_hint` ends the line for unexpected tensors
    (what config.json must agree on)."""
    sd = {k: v for k, v in read_state_dict(input_dir).items()
          if not k.endswith("rotary_emb.inv_freq") and not (drop is not None and drop(k))}
    if not meta["untie_embeddings_and_output_weights"] and "lm_head.weight" in sd:
        if not torch.equal(sd["lm_head.weight"], sd.get("model.embed_tokens.weight", torch.empty(0))):
            raise UserError(f"{input_dir}: lm_head.weight differs from model.embed_tokens.weight but config.json "
                            "says tie_word_embeddings=true: the weights and the config disagree")
        del sd["lm_head.weight"]
    missing = [k for k in expected if k not in sd]
    if missing:
        raise UserError(f"{input_dir}: no tensor {missing[0]!r} ({len(missing)} missing) in the weight files: "
                        "they do not match config.json")
    extra = sorted(k for k in sd if k not in expected)
    if extra:
        raise UserError(f"{input_dir}: the weight files hold {extra[0]!r} ({len(extra)} unexpected), which "
                        f"config.json's {architecture} does not have{extra_hint}")
    for k, shape in expected.items():
        if tuple(sd[k].shape) != shape:
            raise UserError(f"{input_dir}: {k} has shape {tuple(sd[k].shape)}, config.json implies {shape}")
    return sd
