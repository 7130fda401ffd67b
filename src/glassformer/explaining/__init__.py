"""glassformer.explaining"""
