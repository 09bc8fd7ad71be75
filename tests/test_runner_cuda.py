"""On a GPU: CUDA-graph replays compute what the same steps compute eagerly.

* tiny model: the Thinker's greedy tokens and the Talker's frames (greedy and seeded)
  are identical with and without graphs, batched; the runner's bfloat16 logits (fused
  projections, in-place attention) match the model's own forward within bf16 tolerance; Code2Wav graph windows (padded to a
  bucket) equal eager decodes within float32 tolerance.
* full size (``OMNIRELAY_TEST_FULL_SIZE=1``, ~70 GiB of GPU memory): the dummy 30B
  Thinker's logits from graphs match eager ones within bf16 tolerance, the Talker's greedy
  frames match, and Code2Wav's windows match.

Skipped without CUDA (CI has none); run them on a GPU machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.models.qwen3_omni import Checkpoint, encode_chat_prompt
from omnirelay.models.qwen3_omni.code2wav import open_code2wav
from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint
from omnirelay.models.qwen3_omni.talker import TalkerExecutor
from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
from omnirelay.models.runner import Buckets, Row, ThinkerRunner
from omnirelay.models.runner.code2wav import GraphedCode2Wav
from tests.test_models_support import run_thinker, tiny_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FULL_SIZE = os.environ.get("OMNIRELAY_TEST_FULL_SIZE") == "1"
STEPS = 12


def _tiny(device: str = "cuda:0") -> Checkpoint:
    return Checkpoint.open(tiny_dir(), device=device)


def _thinker(graphs: bool) -> ThinkerExecutor:
    args = ModelArgs(
        device="cuda:0", runner="static", cuda_graphs=graphs, compile=False, max_num_seqs=8, max_model_len=256
    )
    return ThinkerExecutor.from_checkpoint(_tiny(), args)


def test_tiny_thinker_graphs_give_the_greedy_tokens_of_eager() -> None:
    graphed, eager = _thinker(True), _thinker(False)
    assert graphed.runner is not None and len(graphed.runner.graphs) > 0
    assert eager.runner is not None and len(eager.runner.graphs) == 0
    tok = graphed.tokenizer
    prompts = {
        "a": encode_chat_prompt(tok, "Hello there, how are you today?"),
        "b": encode_chat_prompt(tok, "Tell me a story."),
        "c": encode_chat_prompt(tok, "Hi", system="Be brief."),
    }
    got = run_thinker(graphed, prompts, STEPS)
    want = run_thinker(eager, prompts, STEPS)
    for rid in prompts:
        assert got[rid].tokens == want[rid].tokens, rid
    assert graphed.runner.graphs.num_replays >= STEPS and graphed.runner.graphs.num_eager == 0


def test_tiny_thinker_fused_runner_logits_match_the_models_forward_in_bfloat16() -> None:
    """Fused QKV, norms and rotary, in-place decode attention, graphs: the last-token
    logits of a prefill and 8 decodes against the model's own ``transformers`` forward
    over the whole sequence, within bfloat16's rounding (3 % relative: a few units of
    2^-8 per operation, over two layers; a wrong slot, weight or rotation is off by far
    more)."""
    from tests.test_runner_fused import runner_vs_model_logits

    error = runner_vs_model_logits("cuda:0", "bfloat16")
    print(f"tiny Thinker runner vs model forward, bf16: relative error {error:.2e}")
    assert error < 3e-2


def _thinker_payloads() -> dict[str, Any]:
    """Thinker -> Talker payloads of two requests (six Thinker steps each) on the tiny model."""
    thinker = ThinkerExecutor.from_checkpoint(_tiny())
    payloads = {}
    for rid, text in (("a", "Hello there!"), ("b", "Tell me a story.")):
        prompt = encode_chat_prompt(thinker.tokenizer, text)
        stream = run_thinker(thinker, {rid: prompt}, 6, accept_hidden_layer=thinker.accept_hidden_layer)[rid]
        payloads[rid] = stream.payloads
    return payloads


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=42)],
    ids=["greedy", "seeded"],
)
def test_tiny_talker_graph_frames_equal_eager_frames(sampling: SamplingParams) -> None:
    from tests.test_models_talker import frames, talk

    payloads = _thinker_payloads()
    results = {}
    for graphs in (True, False):
        args = ModelArgs(
            device="cuda:0",
            runner="static",
            cuda_graphs=graphs,
            compile=False,
            max_num_seqs=8,
            max_model_len=256,
        )
        results[graphs] = talk(TalkerExecutor.from_checkpoint(_tiny(), args=args), payloads, 14, sampling)
    for rid in payloads:
        assert torch.equal(frames(results[True][rid]), frames(results[False][rid])), rid


# inductor's own warnings (a torch.jit API torch deprecates; TF32 left off for this float32
# model): the suite turns warnings into errors
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
def test_tiny_talker_compiled_tail_speaks_the_eager_frames() -> None:
    """The code-predictor tail compiled with inductor and captured in the frame graphs:
    the frames of the eager path, up to the rare tie that fused float math breaks the
    other way (then every later codebook of that frame may differ too)."""
    compiled_talker_speaks_the_eager_frames(lambda talker: talker.runner.predictor.compile_backend)


def compiled_talker_speaks_the_eager_frames(
    backend_of: Any, before_build: Any = lambda compiled: None
) -> None:
    """The tiny Qwen3-Omni Talker built compiled (inductor, in its frame graphs) and eager,
    ``before_build(compiled)`` run before each build; ``backend_of(talker)`` names the
    compiled part's backend. Their frames agree up to the rare tie that fused float math
    breaks the other way: the first frame exactly, at least 95 % of every frame."""
    from tests.test_models_talker import frames, talk

    payloads = _thinker_payloads()
    results = {}
    for compiled in (True, False):
        before_build(compiled)
        args = ModelArgs(
            device="cuda:0",
            runner="static",
            cuda_graphs=compiled,
            compile=compiled,
            max_num_seqs=8,
            max_model_len=256,
        )
        talker = TalkerExecutor.from_checkpoint(_tiny(), args=args)
        assert talker.runner is not None
        assert backend_of(talker) == ("inductor" if compiled else None)
        results[compiled] = talk(talker, payloads, 14, SamplingParams())
    for rid in payloads:
        got, want = frames(results[True][rid]), frames(results[False][rid])
        assert got.shape == want.shape
        assert torch.equal(got[0], want[0]), rid
        assert float((got == want).float().mean()) >= 0.95, rid


def _window_check(model: Any, shapes: list[tuple[int, int]]) -> None:
    """Graph windows (padded to a bucket) against eager decodes of the real windows:
    relative error within TF32 convolution noise (other shapes, other algorithms)."""
    graphed = GraphedCode2Wav(model, cuda_graphs=True)
    graphed.capture_graphs()
    assert len(graphed.graphs) > 0, f"graphs dropped: padding error {graphed.padding_error}"
    replays = graphed.graphs.num_replays
    gen = torch.Generator().manual_seed(1)
    q, size = int(model.config.num_quantizers), int(model.config.codebook_size)
    with torch.inference_mode():
        for b, t in shapes:
            codes = torch.randint(0, size, (b, q, t), generator=gen)
            want = model(codes.to(graphed.device))
            got = graphed(codes)
            assert got.shape == want.shape, (b, t)
            error = _relative(got, want)
            print(f"code2wav window {b}x{t}: relative error {error:.2e}")
            assert error < 1e-2, (b, t, error)
    assert graphed.graphs.num_replays == replays + len(shapes)


def _stream_check(model: Any, lengths: list[int], chunk_sizes: list[int], tolerance: float) -> None:
    """Streams decoded chunk by chunk with their state, in graph replays, against the
    whole-utterance decode: relative error within ``tolerance``."""
    from omnirelay.models.runner.vocoder import StreamingVocoder, StreamRow

    voc = StreamingVocoder(model, max_streams=len(lengths), cuda_graphs=True)
    voc.capture_graphs()
    assert len(voc.graphs) > 0
    gen = torch.Generator().manual_seed(2)
    q, size = int(model.config.num_quantizers), int(model.config.codebook_size)
    codes = [torch.randint(0, size, (q, n), generator=gen) for n in lengths]
    sent = [0] * len(lengths)
    pieces: list[list[torch.Tensor]] = [[] for _ in lengths]
    step = 0
    with torch.inference_mode():
        while any(s < n for s, n in zip(sent, lengths)):
            rows, owners = [], []
            for i, n in enumerate(lengths):
                if sent[i] < n:
                    k = min(chunk_sizes[(step + i) % len(chunk_sizes)], n - sent[i])
                    rows.append(StreamRow(f"s{i}", codes[i][:, sent[i] : sent[i] + k]))
                    owners.append(i)
                    sent[i] += k
            for i, piece in zip(owners, voc.decode(rows)):
                pieces[i].append(piece)
            step += 1
        for i, c in enumerate(codes):
            want = model(c.unsqueeze(0).to(voc.device))[0, 0]
            got = torch.cat(pieces[i])
            assert got.shape == want.shape
            error = _relative(got, want)
            print(
                f"code2wav stream of {lengths[i]} frames in chunks {chunk_sizes}: relative error {error:.2e}"
            )
            assert error < tolerance, (i, error)
    assert voc.graphs.num_replays > 0


def test_tiny_code2wav_streams_with_state_equal_the_whole_utterance() -> None:
    executor = open_code2wav(_tiny(), ModelArgs(device="cuda:0"))
    _stream_check(executor.model, [40, 23, 1], [1, 2, 5, 8, 3], 1e-2)


def test_tiny_code2wav_graph_windows_equal_eager_decodes() -> None:
    executor = open_code2wav(_tiny(), ModelArgs(device="cuda:0"))
    _window_check(executor.model, [(1, 4), (2, 29), (3, 50), (16, 64), (5, 17)])


# ----------------------------------------------------------------- full size


@pytest.fixture(scope="module")
def full() -> Iterator[Checkpoint]:
    if not FULL_SIZE:
        pytest.skip("set OMNIRELAY_TEST_FULL_SIZE=1 (needs ~70 GiB of GPU memory)")
    yield open_checkpoint(ModelArgs(load_format="dummy", device="cuda:0"))
    torch.cuda.empty_cache()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_full_size_thinker_graph_logits_match_eager(full: Checkpoint) -> None:
    model = full.load_thinker()
    text = getattr(model.model, "language_model", model.model)
    buckets = Buckets(max_num_seqs=4, max_model_len=512, batch_sizes=(1, 4), prefill_tokens=(64,))

    def runner(graphs: bool) -> ThinkerRunner:
        r = ThinkerRunner(
            text, model.lm_head, capture_layers=(0, 24), num_text_ids=256, buckets=buckets, cuda_graphs=graphs
        )
        r.capture_graphs()
        return r

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (30, 41, 12)]
    outs = {}
    with torch.inference_mode():
        for graphs in (True, False):
            r = runner(graphs)
            rows = [Row(f"r{i}", 0, p, SamplingParams(), torch.Generator()) for i, p in enumerate(prompts)]
            for row in rows:
                r.slots.acquire(row.rid)
            prefill = r.run(rows, decode=False, keep_logits=True)
            logits = [torch.stack([out.logits for out in prefill if out.logits is not None])]
            for step in range(3):
                decode_rows = [
                    Row(row.rid, r.slots.length(row.rid), [7 + step + i], SamplingParams(), torch.Generator())
                    for i, row in enumerate(rows)
                ]
                outs_ = r.run(decode_rows, decode=True, keep_logits=True)
                logits.append(torch.stack([out.logits for out in outs_ if out.logits is not None]))
            assert r.graphs.num_eager == (0 if graphs else 4)
            outs[graphs] = (prefill, torch.stack(logits))
            del r
            torch.cuda.empty_cache()
    (p_graph, l_graph), (p_eager, l_eager) = outs[True], outs[False]
    l_graph, l_eager = l_graph[..., :256], l_eager[..., :256]  # past the text ids: -inf in both
    for a, b in zip(p_graph, p_eager):
        for layer in (0, 24):
            assert _relative(a.hidden[layer], b.hidden[layer]) < 2e-2
    error = _relative(l_graph, l_eager)
    print(
        f"thinker logits, graph vs eager: relative error {error:.2e}, max abs {float((l_graph - l_eager).abs().max()):.2e}"
    )
    assert error < 2e-2
    assert torch.isfinite(l_graph).all()


def test_full_size_talker_graph_frames_equal_eager_frames(full: Checkpoint) -> None:
    from omnirelay.models.runner import TalkerRow, TalkerRunner

    model = full.load_talker()
    buckets = Buckets(max_num_seqs=4, max_model_len=512, batch_sizes=(1, 4), prefill_tokens=(64,))
    gen = torch.Generator().manual_seed(0)
    conditioning = [
        torch.randn(n, 1024, generator=gen).mul(0.02).to("cuda:0", torch.bfloat16) for n in (40, 33)
    ]
    text = [torch.randn(1, 1024, generator=gen).mul(0.02).to("cuda:0", torch.bfloat16) for _ in range(8)]
    codes = {}
    with torch.inference_mode():
        for graphs in (True, False):
            r = TalkerRunner(
                model,
                codebook_size=2048,
                codec_eos=2150,
                num_code_groups=16,
                buckets=buckets,
                cuda_graphs=graphs,
            )
            r.capture_graphs()
            rows = [
                TalkerRow(f"r{i}", c, SamplingParams(), torch.Generator()) for i, c in enumerate(conditioning)
            ]
            for row in rows:
                r.slots.acquire(row.rid)
            frames = [r.prefill(rows)]
            for step in range(4):
                step_rows = [
                    TalkerRow(row.rid, text[2 * step + i], row.sampling, row.generator)
                    for i, row in enumerate(rows)
                ]
                frames.append(r.decode(step_rows))
            codes[graphs] = torch.stack(frames)
            del r
    assert torch.equal(codes[True], codes[False])


def test_full_size_code2wav_graph_windows_equal_eager_decodes(full: Checkpoint) -> None:
    _window_check(full.load_code2wav(), [(1, 4), (1, 29), (4, 50), (16, 50)])


def test_full_size_code2wav_streams_with_state_equal_the_whole_utterance(full: Checkpoint) -> None:
    _stream_check(full.load_code2wav(), [120, 75], [1, 2, 4, 8, 25], 2e-2)
