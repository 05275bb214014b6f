"""The pool scripts as ``.lua`` files (package data), loaded once by
:mod:`tokenfleet.shared.pool.scripts`. Each opens with its KEYS/ARGV header; ``prelude.lua``
holds the local functions they share (``-- @include prelude.lua``)."""
