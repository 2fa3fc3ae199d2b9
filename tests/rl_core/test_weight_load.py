"""Disk updates read into staging buffers and swap by pointer (torch_engine.weight_load)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


def _engine(model_dir: Path):
    from transformers import AutoTokenizer

    from rl_core.inference.torch_engine.engine import TorchEngine, load_model

    model = load_model(str(model_dir))
    return TorchEngine(model, AutoTokenizer.from_pretrained(model_dir), model_path=str(model_dir))


def _perturbed(model_dir: Path, out: Path, *, tied: bool = False) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = tied
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)  # drops the tied lm_head, as HF checkpoints do
    for file in model_dir.iterdir():  # the tokenizer
        if "token" in file.name and not (out / file.name).exists():
            shutil.copy(file, out / file.name)
    return out


def test_staged_tensors_are_fresh_memory_and_swap_in_by_pointer(tiny_model_dir, tmp_path):
    from rl_core.inference.torch_engine.weight_load import read_staged

    engine = _engine(tiny_model_dir)
    new_dir = _perturbed(tiny_model_dir, tmp_path / "new")
    params = dict(engine.model.named_parameters())
    staged = read_staged(str(new_dir), engine.model)
    from safetensors.torch import load_file

    on_disk = load_file(str(new_dir / "model.safetensors"))
    assert set(staged) == set(on_disk)
    for key, tensor in staged.items():
        torch.testing.assert_close(tensor, on_disk[key])
    engine.install_weights(staged, "3", str(new_dir))
    assert engine.weight_version == "3"
    assert engine.model_path == str(new_dir)
    for name, param in engine.model.named_parameters():
        assert param is params[name]  # the same Parameter objects (hooks, adapters stay)
        assert param.data_ptr() == staged[name].data_ptr()  # no copy


def test_tied_weights_follow_the_one_tensor_on_disk(tiny_model_dir, tmp_path):
    from rl_core.inference.torch_engine.weight_load import read_staged

    tied_dir = _perturbed(tiny_model_dir, tmp_path / "tied", tied=True)
    engine = _engine(tied_dir)
    new_dir = _perturbed(tied_dir, tmp_path / "tied-new", tied=True)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    staged = read_staged(str(new_dir), engine.model)
    assert "lm_head.weight" not in staged
    engine.install_weights(staged, None)
    head = engine.model.get_output_embeddings().weight
    embed = engine.model.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr() == staged["model.embed_tokens.weight"].data_ptr()
    assert head.abs().sum() > 0


def test_what_cannot_be_staged_is_refused(tiny_model_dir, tmp_path):
    from rl_core.inference.torch_engine.weight_load import NotStageable, read_staged

    engine = _engine(tiny_model_dir)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotStageable, match="no .safetensors"):
        read_staged(str(empty), engine.model)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    save_file({f"base.{k}": v for k, v in state.items()}, str(renamed / "model.safetensors"))
    with pytest.raises(NotStageable, match="lacks"):
        read_staged(str(renamed), engine.model)
    partial = tmp_path / "partial"
    partial.mkdir()
    first = next(iter(state))
    save_file({first: state[first]}, str(partial / "model.safetensors"))
    with pytest.raises(NotStageable, match="lacks tensors"):
        read_staged(str(partial), engine.model)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_file({**state, first: torch.zeros(3, 5)}, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        read_staged(str(wrong), engine.model)
