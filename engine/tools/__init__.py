"""Offline tools built on the engine (the EAGLE trainer). Nothing the engine or the server
imports reaches this package: it sits above every runtime room."""
