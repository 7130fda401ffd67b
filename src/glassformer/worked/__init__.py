"""glassformer.worked"""
