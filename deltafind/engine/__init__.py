"""The engine: sampling, generation loops and (later) the scheduler. Speaks token ids, never text."""
