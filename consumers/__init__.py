"""consumers"""
