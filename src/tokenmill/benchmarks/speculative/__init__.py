"""``tokenmill bench speculative``: decode speed with and without speculative decoding, same run."""
