"""Text repeated from elsewhere (what a job wrote, a refusal's details, an event's message), held to a bound."""


def clip(text: str, limit: int) -> str:
    """At most `limit` characters of `text`: when it is longer, its start and "..." (counted in `limit`)."""
    return text if len(text) <= limit else f"{text[:limit - 3]}..."
