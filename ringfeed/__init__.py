"""What every ringfeed package uses: the one user-facing error type (errors.py) and the atomic
file writes, sizes and hashes (fsutil.py). shards/, pipeline/ and train/ import from here;
nothing here imports them."""
