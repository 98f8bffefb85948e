"""Preflight: gather a snapshot once (:mod:`.local`), judge it with pure checks (:mod:`.checks`)."""
