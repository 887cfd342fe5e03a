"""Reading rendered pages in tests."""

from html.parser import HTMLParser
from urllib.parse import urlsplit

# Attributes through which a browser fetches something by itself.
_FETCHING_ATTRIBUTES = {"src", "href", "srcset", "data", "action", "poster"}


class _UrlCollector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":  # a link is followed only on a click; it fetches nothing
            return
        self.urls += [value for name, value in attrs if name in _FETCHING_ATTRIBUTES and value]


def offsite_urls(html: str) -> list[str]:
    """The asset URLs in a page that name another host (ops sites are often air-gapped: every asset
    must come from the console itself). Looks at the markup's attributes only, so a random token
    in the page (a CSRF value that happens to spell "cdn") cannot fail a test."""
    collector = _UrlCollector()
    collector.feed(html)
    return [url for url in collector.urls if urlsplit(url.strip()).netloc]
