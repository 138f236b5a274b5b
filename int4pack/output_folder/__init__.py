"""The output on disk: shards written at precomputed offsets, their checksums, and the hidden work
folder (marker, lock, progress, resume state) that becomes OUT in one rename."""
