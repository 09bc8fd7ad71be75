"""The CPU voice family: SmolLM2 as a streaming text Thinker, a Piper ONNX voice, its
phonemizer and the spelling-out of numbers and abbreviations."""
