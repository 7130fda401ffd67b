"""glassformer.train"""
