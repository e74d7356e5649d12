"""The wire: messages and their extensions, errors, a framed connection
(channel), and the keys and seals of a link. Nothing here knows of a step."""
