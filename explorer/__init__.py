"""The Qt front end of the paged KV-cache explorer.

It reads immutable engine snapshots and sends commands through an EngineRunner; it never reaches into the engine's
internals, so the engine stays usable headless and the GUI can never see a half-updated pool.
"""
