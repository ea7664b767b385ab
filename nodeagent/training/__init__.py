"""Local training: datasets (data), their division among nodes (splits), models, minibatches and evaluation
(loop)."""
