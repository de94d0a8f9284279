"""Where a model comes from: torchvision families, timm, the user's factory, and code-free files."""
