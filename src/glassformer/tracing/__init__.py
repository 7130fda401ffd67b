"""glassformer.tracing"""
