"""What every layer uses: atomic file writes (``fileio``), named crash points (``faults``),
saying that a wait goes on (``waiting``), option dataclasses and their error (``options``)."""
