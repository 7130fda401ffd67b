"""glassformer.checkpoint"""
