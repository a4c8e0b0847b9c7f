"""The HTTP client the openai package depends on (httpx, or its successor httpx2 in newer releases)."""
try:
    import httpx2 as httpx
except ImportError:
    import httpx

__all__ = ["httpx"]
