"""Offline training of an EAGLE-1 draft head: ``python -m engine.spec_decode.train_eagle``."""
