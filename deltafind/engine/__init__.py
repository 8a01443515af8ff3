"""The engine: one core (schedule, execute, update) driven by the daemon's scheduler or synchronously; sampling, speculative decoding, constraints. Speaks token ids, never text."""
