"""Muon settings that must compute what one process computes, or fail loudly when built.

- The learning-rate ratio comes from the block each Newton–Schulz runs on, in every layout:
  blockwise Muon on (dp, tp) = (1, 2) scales each tensor-parallel piece by the piece's ratio,
  exactly as the one-process run with the pieces as ``blocks=``.
- Which parameters Muon takes is decided by what they are (``optim.muon_labels(model)``: module
  type, tied and output roles), whatever they are called; a model whose head cannot be told
  apart is refused, with the candidates named.
- ``optim.streamed`` refuses a device this torch cannot use when it is built, not at the first
  update.
"""

import pytest
import torch
from torch import nn

import fsdpfn
from fsdpfn import optim, testing

# ---------------------------------------------------------------------------------------------
# The learning-rate ratio of blockwise Muon under tp
# ---------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 96)  # colwise: two 48 x 32 pieces
        self.out = nn.Linear(96, 32)  # rowwise: two 32 x 48 pieces


# The tp pieces written as the blocks of one process: rows of fc, columns of out.
PIECES = {"fc.weight": 2, "out.weight": (1, 2)}


def _grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _blockwise_vs_blocks(rank, world, adjust_lr_fn, blocks, mesh_shape=(1, 2)):
    torch.manual_seed(0)
    model = MLP()
    plan = fsdpfn.plan(model, testing.mesh(mesh_shape, ("dp", "tp")), tp={"fc": "colwise", "out": "rowwise"})
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = fsdpfn.shard(model, plan)
    kw = dict(lr=1.0, weight_decay=0.0, ns_dtype=torch.float32, adjust_lr_fn=adjust_lr_fn)
    opt = optim.muon(**kw, layout="blockwise", blocks=blocks)
    ref_opt = optim.muon(**kw, blocks=PIECES)
    state, ref_state = opt.init(params), ref_opt.init(ref)
    worst = {}
    for step in range(2):
        g = _grads(model, 10 + step)
        updates, state = opt.update(fsdpfn.shard(g, plan, check=False), state, params)
        ref_updates, ref_state = ref_opt.update(g, ref_state, ref)
        for n in ref_updates:
            got, want = updates[n].full_tensor(), ref_updates[n]
            worst[n] = max(worst.get(n, 0.0), ((got - want).abs().max() / want.abs().max()).item())
        params, ref = optim.apply_updates(params, updates), optim.apply_updates(ref, ref_updates)
    return worst, {n: torch.equal(params[n].full_tensor(), ref[n]) for n in ref}


@pytest.mark.parametrize("adjust_lr_fn", ["original", "spectral_norm"])
@pytest.mark.parametrize("blocks", [None, {"fc.weight": 1}], ids=["whole", "user-blocks"])
def test_blockwise_under_tp_scales_each_piece_by_its_own_ratio(run_on_ranks, adjust_lr_fn, blocks):
    # With dp = 1 each rank holds its pieces whole: the same Newton–Schulz calls on the same bits
    # as the one-process blocks, then the same scalar product, so the runs agree bit for bit
    # (before the fix fc's pieces got sqrt(96/32) instead of sqrt(48/32): 41% too large).
    for worst, bitwise in run_on_ranks(_blockwise_vs_blocks, 2, adjust_lr_fn, blocks):
        assert all(bitwise.values()), (worst, bitwise)
        assert max(worst.values()) == 0.0, worst


def test_blockwise_under_dp_and_tp_scales_each_piece_by_its_own_ratio(run_on_ranks):
    # dp = 2 cuts each tp piece's rows: the owner assembles the piece from copied bits and runs
    # the same Newton–Schulz call, so again bit for bit.
    for worst, bitwise in run_on_ranks(_blockwise_vs_blocks, 4, "spectral_norm", None, (2, 2)):
        assert all(bitwise.values()) and max(worst.values()) == 0.0, (worst, bitwise)


def test_scale_by_muon_lr_reads_the_layout():
    with pytest.raises(ValueError, match="layout"):
        optim.scale_by_muon_lr(0.1, layout="rowwise")
    # Plain tensors have no tp pieces: blockwise is the whole matrix's ratio.
    u, _ = optim.scale_by_muon_lr(1.0, layout="blockwise").update({"w": torch.ones(4, 1)}, optim.MuonLRState(0))
    assert torch.equal(u["w"], torch.full((4, 1), -2.0))


# ---------------------------------------------------------------------------------------------
# Which parameters Muon takes: decided by what they are
# ---------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)


class Classifier(nn.Module):
    """An embedding called ``emb`` and a head called ``classifier``."""

    def __init__(self, vocab=11, width=8, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.classifier = nn.Linear(width, classes)


class TokLM(nn.Module):
    """``tok_emb`` and an untied ``unembed``."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.unembed = nn.Linear(width, vocab, bias=False)


class TiedLM(nn.Module):
    """``token_embedding`` tied to the output layer, a bare position parameter on the root."""

    def __init__(self, vocab=11, width=8, seq=5):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.pos_table = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.to_logits = nn.Linear(width, vocab, bias=False)
        self.to_logits.weight = self.token_embedding.weight


HIDDEN = {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("fc", "proj")}


@pytest.mark.parametrize("cls", [Classifier, TokLM, TiedLM])
def test_muon_labels_decide_by_module_not_name(cls):
    torch.manual_seed(0)
    model = cls()
    labels = optim.muon_labels(model)
    assert {n for n, lab in labels.items() if lab == "muon"} == HIDDEN, labels
    # Every name a parameter goes by (a tied weight's second name too) has a label.
    assert set(labels) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    # The optimizer built from them keeps Muon state exactly for the hidden matrices.
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = optim.muon(lr=0.02, labels=labels).init(params)
    bufs = state.inner_states["muon"][0].momentum_buffer
    assert {n for n, b in bufs.items() if b is not None} == HIDDEN


class HeadFirst(nn.Module):
    """The head registered before the blocks: the last nn.Linear is a block's."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.classifier = nn.Linear(width, 3)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))


def test_muon_labels_refuse_to_guess_the_head():
    model = HeadFirst()
    with pytest.raises(ValueError) as e:
        optim.muon_labels(model)
    msg = str(e.value)
    assert "'blocks.1.proj'" in msg and "muon_labels(model, head='classifier')" in msg and "head=None" in msg, msg
    labels = optim.muon_labels(model, head="classifier")
    assert {n for n, lab in labels.items() if lab == "muon"} == HIDDEN
    # A model without an output layer: every matrix but the embedding is hidden.
    labels = optim.muon_labels(model, head=None)
    assert {n for n, lab in labels.items() if lab == "muon"} == HIDDEN | {"classifier.weight"}
    with pytest.raises(ValueError, match="'clasifier'.*nn.Linear"):
        optim.muon_labels(model, head="clasifier")


def test_muon_labels_with_sequential_heads_and_blocks():
    # A head that is an nn.Sequential: its last layer is the output, its first one hidden.
    model = nn.Sequential()
    model.emb = nn.Embedding(11, 8)
    model.head = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    labels = optim.muon_labels(model)
    assert labels["head.0.weight"] == "muon" and labels["head.2.weight"] == "adamw" and labels["emb.weight"] == "adamw"
    # Blocks in an nn.Sequential, nothing after them: the last Linear is a block's.
    model = nn.Sequential(nn.Embedding(11, 8), Block(8), Block(8))
    with pytest.raises(ValueError, match="'2.proj'.*repeated block '2'"):
        optim.muon_labels(model)


def test_muon_takes_the_model_as_labels():
    model = TokLM()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = optim.muon(lr=0.02, labels=model).init(params)
    assert {n for n, b in state.inner_states["muon"][0].momentum_buffer.items() if b is not None} == HIDDEN
    with pytest.raises(ValueError, match="cannot tell the output layer"):
        optim.muon(lr=0.02, labels=HeadFirst())  # when built, before any parameter is seen


def test_muon_labels_by_name_still_work():
    # The name rule muon uses without a model, unchanged for existing call sites.
    assert optim.muon_labels("blocks.0.fc.weight", torch.zeros(8, 4)) == "muon"
    assert optim.muon_labels("embed.weight", torch.zeros(8, 4)) == "adamw"
    with pytest.raises(TypeError, match="muon_labels"):
        optim.muon_labels(42)


@pytest.mark.parametrize(
    "model", [Classifier(), TokLM(), TiedLM()], ids=["emb-classifier", "tok_emb-unembed", "tied-pos_table"]
)
def test_muon_default_name_rule_knows_common_embedding_and_head_names(model):
    # Without a model, muon reads names: the usual spellings of embeddings and heads (emb,
    # tok_emb, token_embedding, unembed, classifier) and a bare position table (pos_table: Muon
    # before, AdamW by the module rule) must reach AdamW, as the module rule says. The tree muon
    # sees has each tensor once (a tied weight under its first name), as named_parameters() gives.
    by_name = {n: optim.muon_labels(n, p) for n, p in model.named_parameters()}
    by_module = optim.muon_labels(model)
    assert by_name == {n: by_module[n] for n in by_name}
    assert optim.muon_labels("encoder.word_embeddings.weight", torch.zeros(8, 4)) == "adamw"
    assert optim.muon_labels("member.weight", torch.zeros(8, 4)) == "muon"  # not an embedding


def test_muon_labels_on_gpt_equal_the_name_rule():
    from fsdpfn.models import GPT, GPTConfig

    for tie in (False, True):
        model = GPT(GPTConfig(vocab_size=32, width=16, depth=2, heads=2, tie_embeddings=tie))
        by_module = optim.muon_labels(model)
        by_name = {n: optim.muon_labels(n, p) for n, p in model.named_parameters(remove_duplicate=False)}
        assert by_module == by_name


# ---------------------------------------------------------------------------------------------
# streamed: the device is checked when built
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_streamed_refuses_an_unavailable_device_when_built():
    with pytest.raises(ValueError, match=r"device='cuda'.*device='cpu'"):
        optim.streamed(optim.adamw(1e-3), device="cuda")
    with pytest.raises(ValueError, match="'gpu'"):
        optim.streamed(optim.adamw(1e-3), device="gpu")
    optim.streamed(optim.adamw(1e-3), device="cpu")  # the CPU is always there


def test_muon_labels_on_hf_models():
    T = pytest.importorskip("transformers")
    llama = T.LlamaForCausalLM(
        T.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=50,
        )
    )
    bert = T.BertForSequenceClassification(
        T.BertConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=50)
    )
    for model, out in (
        (llama, {"lm_head.weight", "model.embed_tokens.weight"}),
        (
            bert,
            {
                "classifier.weight",
                *(f"bert.embeddings.{k}_embeddings.weight" for k in ("word", "position", "token_type")),
            },
        ),
    ):
        labels = optim.muon_labels(model)
        matrices = {n for n, p in model.named_parameters() if p.dim() >= 2}
        assert {n for n in matrices if labels[n] == "adamw"} == out, sorted(n for n in matrices if labels[n] == "adamw")
