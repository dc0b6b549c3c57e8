-- SQL work for `cargo xtask bench --servers`, run by sqlite3 on an in-memory database, so that
-- every page and every row passes through glibc's malloc: 200,000 rows of strings and random
-- blobs made by a recursive CTE, two indexes, group-by and sorting queries, an update that
-- resizes a third of the rows and a delete. `.timer on` prints each statement's time; the bench
-- adds up their `real` seconds (sqlite3's start-up and a tracer's are not counted).
.bail on
.timer on
CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT, tag TEXT, grp INTEGER, payload BLOB);
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
  INSERT INTO items(name, tag, grp, payload)
  SELECT printf('item-%d-%s', i, hex(randomblob(8))), substr('abcdefghij', 1 + i % 10, 3), i % 997,
         randomblob(64 + i % 200)
  FROM n;
CREATE INDEX items_name ON items(name);
CREATE INDEX items_grp_tag ON items(grp, tag);
SELECT grp, count(*), sum(length(payload)), max(name) FROM items GROUP BY grp ORDER BY 3 DESC LIMIT 3;
SELECT tag, count(DISTINCT grp), length(group_concat(name)) FROM items GROUP BY tag;
SELECT count(*), max(k) FROM (SELECT tag || name AS k FROM items ORDER BY k DESC LIMIT 50000);
UPDATE items SET payload = zeroblob(32), name = name || '-updated' WHERE id % 3 = 0;
DELETE FROM items WHERE grp < 100;
SELECT count(*), sum(length(name)), sum(length(payload)) FROM items;
