"""What a run leaves on disk: checkpoint directories and their manifests, safe loading, the run
directory's records and ownership, overwrite, consolidation into a Hugging Face or peft directory."""
