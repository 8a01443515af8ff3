"""The expert store: on-disk layout, import (setup), readers, cache and provider."""
