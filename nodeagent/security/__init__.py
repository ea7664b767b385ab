"""Certificates, identities and the authorisation rules both daemons apply."""
