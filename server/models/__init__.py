"""What to serve (models.toml) and loading it: local directories, hub repos, GGUF files in packages."""
