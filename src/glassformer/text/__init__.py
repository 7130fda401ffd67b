"""glassformer.text"""
