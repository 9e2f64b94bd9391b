"""fsdpfn.load_safetensors: pretrained weights read straight into shards, each rank reading only
its rows, against the full state dict bitwise (single file and the HF index layout, renamed keys,
tied weights, a dim smaller than the world size, a dtype cast); every bad checkpoint named."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fsdpfn
from fsdpfn import comm, testing
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=29, seq_len=8, width=12, depth=2, heads=2, tie_embeddings=True)


class Model(nn.Module):
    """A GPT with tied embeddings, a parameter with fewer rows than ranks (2 on W = 3) and a 0-d one."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(CFG)
        self.small = nn.Parameter(torch.randn(2, 5))
        self.scale = nn.Parameter(torch.tensor(1.5))


def _meta_model():
    with torch.device("meta"):
        return Model()


def _state(seed=0):
    """The full state dict, every parameter under its first name (tied: ``gpt.embed.weight``)."""
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in Model().named_parameters()}


def _hf_name(name):
    return "transformer." + name.removeprefix("gpt.").replace("blocks.", "h.") if name.startswith("gpt.") else name


def _from_hf(key):
    return "gpt." + key.removeprefix("transformer.").replace("h.", "blocks.") if key.startswith("transformer.") else key


def _write(directory, state, layout, files=3):
    """Writes ``state`` as one ``model.safetensors`` or as ``files`` files plus
    ``model.safetensors.index.json``, like ``save_pretrained``."""
    os.makedirs(directory, exist_ok=True)
    if layout == "single":
        save_file(state, os.path.join(directory, "model.safetensors"))
        return
    names = list(state)
    weight_map = {}
    for i in range(files):
        part = names[i::files]
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: state[n].contiguous() for n in part}, os.path.join(directory, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def _case(kind):
    """(checkpoint tensors, rename) for each way a checkpoint can name the model's tensors."""
    state = _state()
    if kind == "plain":
        return state, None
    if kind == "tied-alias":  # HF's habit: the tied tensor saved under the other name only
        state["gpt.head.weight"] = state.pop("gpt.embed.weight")
        return state, None
    if kind == "tied-both":
        state["gpt.head.weight"] = state["gpt.embed.weight"].clone()
        return state, None
    if kind == "renamed-fn":
        return {_hf_name(n): v for n, v in state.items()}, _from_hf
    if kind == "renamed-dict":  # a dict for some names; an extra buffer dropped with None
        state = {("lm.bias" if n == "gpt.norm.bias" else n): v for n, v in state.items()}
        state["gpt.attn_mask"] = torch.ones(3, 3)
        return state, {"lm.bias": "gpt.norm.bias", "gpt.attn_mask": None}
    if kind == "bf16":
        return {n: v.to(torch.bfloat16) for n, v in state.items()}, None
    raise AssertionError(kind)


def _load(rank, world, directory, kind, strategy, mesh_shape):
    _, rename = _case(kind)
    model = _meta_model()
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    plan = fsdpfn.plan(model, testing.mesh(mesh_shape, names), strategy=strategy)
    params = fsdpfn.load_safetensors(model, plan, directory, rename=rename)
    assert list(params) == list(plan.param_names)
    for n, p in params.items():
        assert p.placements == fsdpfn.transforms.placements(plan, n) and p.dtype == torch.float32
        local = p.to_local()  # its own memory, not a view of the file's map (nor of the whole tensor)
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size()
    return {n: comm.full_tensor(p) for n, p in params.items()}


@pytest.mark.parametrize("layout", ["single", "index"])
@pytest.mark.parametrize(
    "kind,world,strategy,mesh",
    [
        ("plain", 2, "zero3", (2,)),
        ("plain", 3, "zero3", (3,)),
        ("tied-alias", 3, "zero3", (3,)),
        ("tied-both", 2, "zero2", (2,)),
        ("renamed-fn", 3, {"*": "zero3", "<root>": "replicate"}, (3,)),
        ("renamed-dict", 2, "zero3", (2,)),
        ("bf16", 3, "zero3", (3,)),
        ("plain", 4, "zero3", (2, 2)),
    ],
    ids=["w2", "w3", "w3-tied-alias", "w2-tied-both", "w3-renamed-fn", "w2-renamed-dict", "w3-bf16", "hsdp2x2"],
)
def test_loads_the_full_state_dict_bitwise(run_on_ranks, tmp_path, layout, kind, world, strategy, mesh):
    tensors, _ = _case(kind)
    _write(tmp_path, tensors, layout)
    expected = {n: v.to(torch.bfloat16).float() if kind == "bf16" else v for n, v in _state().items()}
    for full in run_on_ranks(_load, world, str(tmp_path), kind, strategy, mesh):
        assert sorted(full) == sorted(expected)
        assert all(torch.equal(full[n], expected[n]) for n in expected), [
            n for n in expected if not torch.equal(full[n], expected[n])
        ]


def _rows_read(rank, world, path):
    """Which rows of which tensor this rank asked safetensors for."""
    asked = []
    from fsdpfn.transforms import _safetensors as module

    original = module._read_box

    def spy(f, entry, box, dtype, device):
        asked.append((entry.key, box[0].start, box[0].stop) if box else (entry.key, 0, 1))
        return original(f, entry, box, dtype, device)

    module._read_box = spy
    try:
        model = _meta_model()
        plan = fsdpfn.plan(model, testing.mesh((world,)))
        fsdpfn.load_safetensors(model, plan, path)
    finally:
        module._read_box = original
    return asked


def test_each_rank_reads_only_its_rows(run_on_ranks, tmp_path):
    _write(tmp_path, _state(), "single")
    for rank, asked in enumerate(run_on_ranks(_rows_read, 3, str(tmp_path))):
        for key, start, stop in asked:
            shape = _state()[key].shape
            if shape:
                assert (start, stop) == fsdpfn._rows.chunk_bounds(shape[0], 3, rank), (key, start, stop)
        assert ("small", min(2, rank), min(2, rank + 1)) in asked  # 2 rows over 3 ranks: 1, 1, 0


# ---------------------------------------------------------------------------------------------
# Bad checkpoints: every rank raises the same named error before anything is read
# ---------------------------------------------------------------------------------------------


def _check_error(tmp_path, tensors, match, rename=None, layout="single"):
    _write(tmp_path, tensors, layout)
    model = _meta_model()
    plan = fsdpfn.plan(model, (2,))  # unbound: the checks run before any collective or read
    with pytest.raises(ValueError, match=match):
        fsdpfn.load_safetensors(model, plan, str(tmp_path), rename=rename)


def test_missing_tensor_is_named_with_its_shape(tmp_path):
    state = _state()
    del state["gpt.blocks.1.fc.weight"]
    _check_error(
        tmp_path, state, r"missing from the checkpoint \(1\): 'gpt.blocks.1.fc.weight' \(model shape \(48, 12\)\)"
    )


def test_extra_tensor_is_named_with_its_shape(tmp_path):
    state = _state()
    state["gpt.blocks.0.attn.bias"] = torch.zeros(8, 8)
    _check_error(
        tmp_path,
        state,
        r"in the checkpoint but not in the model \(1\): 'gpt.blocks.0.attn.bias' \(checkpoint shape \(8, 8\)\)",
    )


def test_wrong_shape_names_both_shapes(tmp_path):
    state = _state()
    state["gpt.blocks.0.fc.weight"] = torch.zeros(12, 48)
    _check_error(
        tmp_path,
        state,
        r"wrong shape \(1\): 'gpt.blocks.0.fc.weight': checkpoint shape \(12, 48\), model shape \(48, 12\)",
    )


def test_wrong_shape_after_rename_names_the_key(tmp_path):
    state = {_hf_name(n): v for n, v in _state().items()}
    state["transformer.h.0.fc.weight"] = torch.zeros(12, 48)
    _check_error(
        tmp_path,
        state,
        r"'gpt.blocks.0.fc.weight': checkpoint shape \(12, 48\) \(key 'transformer.h.0.fc.weight'\), model shape \(48, 12\)",
        _from_hf,
    )


def test_all_problems_are_listed_together(tmp_path):
    state = _state()
    del state["small"]
    state["extra"] = torch.zeros(2)
    state["scale"] = torch.zeros(3)
    _check_error(tmp_path, state, r"(?s)missing.*'small'.*not in the model.*'extra'.*wrong shape.*'scale'")


def test_two_keys_renamed_to_one_name(tmp_path):
    state = _state()
    state["copy_of_small"] = state["small"].clone()
    _check_error(
        tmp_path,
        state,
        r"mapped twice \(1\): 'copy_of_small' and 'small' both map to 'small'|'small' and 'copy_of_small' both map to 'small'",
        rename={"copy_of_small": "small"},
    )


def test_bad_rename(tmp_path):
    _check_error(
        tmp_path, _state(), r"rename names \['nope'\], which the checkpoint does not hold", rename={"nope": "x"}
    )
    _check_error(
        tmp_path,
        _state(),
        r"rename\('gpt.embed.weight'\) returned 3",
        rename=lambda k: 3 if k == "gpt.embed.weight" else k,
    )
    _check_error(tmp_path, _state(), "rename must be a dict", rename=["a"])


def test_bad_paths(tmp_path):
    model = _meta_model()
    plan = fsdpfn.plan(model, (2,))
    with pytest.raises(ValueError, match="no safetensors checkpoint at"):
        fsdpfn.load_safetensors(model, plan, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="holds no safetensors checkpoint"):
        fsdpfn.load_safetensors(model, plan, str(tmp_path))
    _write(tmp_path / "idx", _state(), "index")
    os.remove(tmp_path / "idx" / "model-00002-of-00003.safetensors")
    with pytest.raises(ValueError, match=r"names files that do not exist: \['.*model-00002-of-00003.safetensors'\]"):
        fsdpfn.load_safetensors(model, plan, str(tmp_path / "idx"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a safetensors index"):
        fsdpfn.load_safetensors(model, plan, str(tmp_path / "bad.json"))
    _write(tmp_path / "lies", _state(), "index")
    index = json.loads((tmp_path / "lies" / "model.safetensors.index.json").read_text())
    index["weight_map"]["small"] = (
        "model-00001-of-00003.safetensors"
        if index["weight_map"]["small"].startswith("model-00002")
        else "model-00002-of-00003.safetensors"
    )
    (tmp_path / "lies" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"the index maps \['small'\] to .*, which does not hold them"):
        fsdpfn.load_safetensors(model, plan, str(tmp_path / "lies"))
    with pytest.raises(ValueError, match="model must be the nn.Module"):
        fsdpfn.load_safetensors(plan, plan, str(tmp_path / "idx"))
    with pytest.raises(ValueError, match="this plan has no mesh"):  # everything else was fine
        _write(tmp_path / "ok", _state(), "single")
        fsdpfn.load_safetensors(model, plan, str(tmp_path / "ok"))


def _untied(rank, world, directory):
    model = _meta_model()
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    try:
        fsdpfn.load_safetensors(model, plan, directory)
    except ValueError as e:
        return str(e)


def test_tied_names_with_different_values_fail_on_every_rank(run_on_ranks, tmp_path):
    state = _state()
    state["gpt.head.weight"] = state["gpt.embed.weight"].clone()
    state["gpt.head.weight"][-1, 0] += 1  # only the last rank's rows differ
    _write(tmp_path, state, "single")
    for message in run_on_ranks(_untied, 3, str(tmp_path)):
        assert (
            message
            and "tied parameters under several names with different values: 'gpt.embed.weight' and 'gpt.head.weight'"
            in message
        )


def _other_checkpoints(rank, world, directories):
    model = _meta_model()
    plan = fsdpfn.plan(model, testing.mesh((world,)))
    try:
        fsdpfn.load_safetensors(model, plan, directories[rank])
    except ValueError as e:
        return str(e)


def test_ranks_reading_different_checkpoints_are_named(run_on_ranks, tmp_path):
    state = _state()
    _write(tmp_path / "a", state, "single")
    state["small"] = torch.zeros(2, 5, dtype=torch.float64)  # other dtype: other headers
    _write(tmp_path / "b", state, "single")
    for message in run_on_ranks(_other_checkpoints, 2, [str(tmp_path / "a"), str(tmp_path / "b")]):
        assert message and "ranks [1] have a different checkpoint (names, shapes, dtypes, files) than rank 0" in message
