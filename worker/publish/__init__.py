"""Publishing: each engine step's tokens, finishes and cancel check in one round trip
(``publisher``), on a connection of its own, written at once and read a step later."""
