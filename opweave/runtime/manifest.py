"""Artifact reading for the runtime: a re-export of `opweave.artifact`, the one module that
writes and reads artifact folders (manifest, checksums, signature, `load_artifact`)."""

from opweave.artifact import (FORMAT, INFO, MANIFEST, MIN_KEY_BYTES, SIGNATURE, VerifiedArtifact,  # noqa: F401
                              load_artifact, load_program_source, rank_files, read_key, read_manifest,
                              sha256_bytes, sha256_file, sha256_text, signature, verify_manifest, write_info,
                              write_manifest)
