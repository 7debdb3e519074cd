"""Saliency masks for RELICv2's background removal, DeepUSPS-style and unsupervised: handcrafted maps
over superpixels (`handcrafted`), scored against ground truth where a dataset has it (`quality`)."""
