"""Media on the wire: client audio and images decoded within limits, audio emitted and
encoded, and chat turns with media submitted the way the pipeline hears and sees them."""
