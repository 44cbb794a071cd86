"""On-disk format: safetensors data files, ``metadata.json`` models, checksums, dtypes."""
