"""Speech recognition and alignment: the PocketSphinx recognizer and aligner, and the
weight-free VAD aligner."""
